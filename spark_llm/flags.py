"""Command-line flags generated from the settings models: one flag per field, its description the help, its type
the parser (``spark-llm run``'s from :class:`~spark_llm.config.BatchConfig`, ``spark-llm serve``'s also from
:class:`~spark_llm.service.ServiceSettings`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
from typing import Any, Literal, Sequence, Union, get_args, get_origin

from .config import GROUPS, BatchConfig

#: Flags besides the generated ones, for the design's names: flag -> config field.
ALIASES = {"--batch-size": "max_num_seqs"}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"quantization\": \"fp8\"}'")
    return value


def _name_value(action: argparse.Action, value: str) -> dict | tuple[str, str]:
    """A flag's ``NAME=VALUE`` as a pair, or its JSON object as a dict."""
    if value.lstrip().startswith("{"):
        return _json_object(value)
    name, sep, target = value.partition("=")
    if not (sep and name and target):
        raise argparse.ArgumentError(action, f"expected {action.metavar} (or a JSON object), got {value!r}")
    return name, target


class _Mapping(argparse.Action):
    """``NAME=VALUE``, repeatable (as ``vllm serve --lora-modules``), or a JSON object; merged into one dict."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: Any = None) -> None:
        given = _name_value(self, value)
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}),
                                       **(given if isinstance(given, dict) else dict([given]))})


class _ModelEntries(argparse.Action):
    """``NAME=PATH``, repeatable, or a JSON object ``{name, path, kind, <engine settings>}``: one more model each."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: Any = None) -> None:
        given = _name_value(self, value)
        entry = given if isinstance(given, dict) else {"name": given[0], "path": given[1]}
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), entry])


def argument_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse settings for a config field's type (Optional[...] unwrapped)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType):
        return argument_kwargs(args[0])
    if get_origin(annotation) is Literal:
        return {"type": str, "choices": list(get_args(annotation))}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(annotation) is dict and get_args(annotation) == (str, str):
        return {"action": _Mapping, "metavar": "NAME=VALUE"}
    if get_origin(annotation) is dict:
        return {"type": _json_object, "metavar": "JSON"}
    if get_origin(annotation) is list:
        return {"action": _ModelEntries, "metavar": "NAME=PATH"}
    return {"type": annotation}


def flag(field: str) -> str:
    """The field's flag: ``--field-name``, or the one its metadata names."""
    extra = BatchConfig.model_fields[field].json_schema_extra or {}
    return extra.get("flag") or "--" + field.replace("_", "-")  # type: ignore[union-attr]


#: What py4j logs, as ERRORs with tracebacks, when Ctrl-C or SIGTERM lands while the main thread is inside a call
#: into the JVM: the interrupt itself, and a failed cleanup of that call's socket when the JVM's end has closed
#: first. The interrupt is the command's own way to cancel (the run then says it was cancelled, once), not an error.
PY4J_INTERRUPTED = frozenset({"KeyboardInterrupt while sending command.",
                              "Exception occurred while shutting down connection"})


def _not_an_interrupted_call(record: logging.LogRecord) -> bool:
    return record.msg not in PY4J_INTERRUPTED


def configure_logging(level: str) -> None:
    """The command's console: spark_llm's own lines at ``level`` (--log-level), other libraries' (py4j, Spark's
    Python side) at WARNING and above only, without py4j's report of a call the command interrupted itself. For
    the command's process alone (a notebook configures its own)."""
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(_not_an_interrupted_call)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[console])
    logging.getLogger("spark_llm").setLevel(level.upper())


def add_run_arguments(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """One flag per BatchConfig field (its description is the help), in the config's groups; none for the
    fields in ``exclude``."""
    parser.add_argument("--config", help="YAML file with settings (see conf/); flags override it")
    parser.add_argument("--master", default=None,
                        help="Spark master when spark-llm starts its own session (default local[2]); ignored "
                             "under spark-submit or in a notebook, where the active session is used")
    parser.add_argument("--remote", default=None,
                        help="run over Spark Connect: a server URL (sc://host:15002, Databricks Connect's too), or "
                             "local[N] to start a local Connect server with Delta")
    parser.add_argument("--log-level", default="INFO", help="log level of spark_llm's own loggers")
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    aliases = {field: [a for a, f in ALIASES.items() if f == field] for field in BatchConfig.model_fields}
    for field, info in BatchConfig.model_fields.items():
        if field in exclude:
            continue
        groups[BatchConfig.group_of(field)].add_argument(
            flag(field), *aliases[field], dest=field, default=None, help=info.description,
            **argument_kwargs(info.annotation))
