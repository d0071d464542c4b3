#!/usr/bin/env python
"""Build a tiny random-weight Llama model directory that vLLM can load, without any download.

The directory holds a 2-layer Llama (hidden 256, bf16, safetensors), a byte-level BPE tokenizer trained here on a
built-in English/Chinese corpus, and a ChatML-style chat template. The output is deterministic for a given --seed:
the same weights and the same tokenizer every time, so greedy decoding gives the same token ids on every run.

    python scripts/make_tiny_model.py --out /tmp/tiny-llm
    python scripts/make_tiny_model.py --kind lora --base /tmp/tiny-llm --out /tmp/tiny-lora
    python scripts/make_tiny_model.py --kind embedding --base /tmp/tiny-llm --out /tmp/tiny-embed
    python scripts/make_tiny_model.py --kind vision --out /tmp/tiny-vlm
    python scripts/make_tiny_model.py --kind classifier --base /tmp/tiny-llm --out /tmp/tiny-moderation
    python scripts/make_tiny_model.py --kind cross-encoder --base /tmp/tiny-llm --out /tmp/tiny-reranker
    python scripts/make_tiny_model.py --kind whisper --out /tmp/tiny-whisper

``--kind embedding`` makes a sentence-transformers directory of the tiny Llama (modules.json: the transformer, mean
pooling, normalisation), which vLLM's pooling runner loads as an embedding model: unit-length vectors of 256 floats.
``--kind classifier`` makes a multi-label sequence classifier of it (LlamaForSequenceClassification) whose labels
are OpenAI's 13 moderation categories: vLLM's classify task gives each a sigmoid score. ``--kind cross-encoder``
makes a one-label classifier of it, a (query, document) relevance scorer for /v1/score and /v1/rerank.
``--kind whisper`` makes a Whisper-shaped speech-to-text model (one encoder and one decoder layer, 80 mel bins at
16 kHz, Whisper's special tokens on the tiny BPE) for /v1/audio/transcriptions and translations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

#: ChatML with Hermes-style tools (as Qwen's templates write them): the tools in a system block, earlier calls as
#: <tool_call>{"name", "arguments"}</tool_call>, tool results as <tool_response> in a user turn.
CHAT_TEMPLATE = (
    "{%- set skip_first = tools and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "<|im_start|>system\n{% if skip_first %}{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call a function answer with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}{% if not (loop.first and skip_first) %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] is none %}{% set content = '' %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('\n') %}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant\n{{ content }}"
    "{% for call in message['tool_calls'] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
#: Ordinary (decoded) tokens that vLLM's hermes tool-call parser and deepseek_r1 reasoning parser look for.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
#: Bumped whenever the built model changes; --if-stale rebuilds a directory built by another version.
VERSION = 2

_EN_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but all they "
    "one their has more can will about been would what there when who out into up so some them other these "
    "model data batch spark request token prompt output error table summary report customer invoice product "
    "review weather translate explain write list short poem story question answer reason step number code "
    "python function delta partition engine inference latency throughput memory cluster executor driver "
    "please give three ideas about summarize following text sentence paragraph email reply polite formal "
    "Paris London Tokyo Beijing Shanghai river mountain ocean city country history science music art"
).split()
_ZH_WORDS = (
    "我们 你好 请 总结 以下 文本 核心 观点 数据 模型 推理 批量 处理 任务 结果 输出 错误 日志 用户 反馈 "
    "情感 分析 意图 识别 信息 抽取 商品 描述 摘要 生成 审核 翻译 成 英文 中文 一句话 解释 什么 是 "
    "大语言模型 离线 吞吐量 显存 集群 服务 部署 天气 北京 上海 今天 明天 为什么 如何 写 一首 诗"
).split()


def _corpus(seed: int, n_lines: int = 20000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        if rng.random() < 0.3:
            words = rng.choices(_ZH_WORDS, k=rng.randint(3, 15))
            lines.append("".join(words) + rng.choice(["。", "？", "！", "，"]))
        else:
            words = rng.choices(_EN_WORDS, k=rng.randint(3, 20))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        if rng.random() < 0.05:
            lines.append(f"{rng.randint(0, 10**6)} {rng.random():.4f} {{\"key\": [{rng.randint(0, 99)}]}}")
    return lines


def build_tokenizer(out: Path, seed: int, vocab_size: int):
    """Train a byte-level BPE tokenizer on the built-in corpus and save it with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos = SPECIAL_TOKENS[0]
    # like Llama: plain prompts start with BOS (chat prompts are encoded without special tokens)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=2048,
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, *, seed: int = 0, vocab_size: int = 4096, hidden: int = 256, layers: int = 2,
                max_len: int = 2048) -> Path:
    """Write the model directory to ``out`` (replaced if present) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    with _model_dir(out) as tmp:
        tokenizer = build_tokenizer(tmp, seed, vocab_size)
        eos_ids = [tokenizer.convert_tokens_to_ids("<|end_of_text|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_len,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=eos_ids,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="bfloat16",
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_ids}, indent=2)
        )
    return out


@contextlib.contextmanager
def _model_dir(out: Path) -> Iterator[Path]:
    """A directory to build a model in, beside ``out`` (the same filesystem: the rename is atomic), that replaces
    ``out`` with this version's marker when the block ends well, and is removed when it does not."""
    out.parent.mkdir(parents=True, exist_ok=True)  # e.g. .cache/ on a fresh clone
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        yield tmp
        (tmp / "tiny_model_version").write_text(str(VERSION))
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build_lora(base: Path, out: Path, *, seed: int = 1, rank: int = 8) -> Path:
    """A LoRA adapter (PEFT layout: adapter_config.json + adapter_model.safetensors) for the tiny Llama at ``base``:
    random rank-``rank`` updates of every layer's q_proj and v_proj, strong enough to change greedy outputs."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(base) / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    outputs = {"q_proj": hidden, "v_proj": kv_heads * (hidden // heads)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, size in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * 0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(size, rank, generator=gen) * 0.5).to(torch.bfloat16)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": sorted(outputs), "base_model_name_or_path": str(base)}, indent=2))
    return out


def build_embedding(base: Path, out: Path) -> Path:
    """A sentence-transformers embedding model from the tiny Llama at ``base`` (its files linked, not copied): the
    transformer's token states, mean-pooled and normalised, as sentence-transformers' modules.json says. spark_llm
    (runner auto) and vLLM read that layout: the pooling runner with mean pooling and unit-length vectors."""
    base, out = Path(base), Path(out)
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-embed-", dir=out.parent if out.parent.exists() else None))
    try:
        for f in base.iterdir():
            if f.is_file():
                try:
                    (tmp / f.name).hardlink_to(f)
                except OSError:  # another filesystem
                    shutil.copy2(f, tmp / f.name)
        (tmp / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
            indent=2))
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}, indent=2))
        (tmp / "2_Normalize").mkdir()
        (tmp / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_classifier(base: Path, out: Path, *, seed: int = 0, cross_encoder: bool = False) -> Path:
    """A sequence classifier from the tiny Llama at ``base``: its transformer, and a random head large enough that
    the sigmoid scores spread over (0, 1). By default multi-label over OpenAI's moderation categories
    (``config.MODERATION_CATEGORIES``; some inputs flagged at 0.5, some not); ``cross_encoder``: one label, a
    relevance score of a (query, document) pair as vLLM's score task and sentence-transformers' CrossEncoder read such
    a model. Its tokenizer and chat template are the tiny Llama's."""
    import torch
    from transformers import LlamaForSequenceClassification

    from spark_llm.config import MODERATION_CATEGORIES

    base, out = Path(base), Path(out)
    labels = {0: "LABEL_0"} if cross_encoder else dict(enumerate(MODERATION_CATEGORIES))
    with _model_dir(out) as tmp:
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification.from_pretrained(
            str(base), num_labels=len(labels), id2label=labels, label2id={v: k for k, v in labels.items()},
            problem_type=None if cross_encoder else "multi_label_classification", dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.1)
        model.config.architectures = ["LlamaForSequenceClassification"]
        model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        for f in base.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy2(f, tmp / f.name)
    return out


#: The chat template of the tiny vision-language model: the tiny Llama's, with a user turn's image parts written as
#: one <image> token each, where vLLM's LLaVA processor puts the picture's tokens.
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('\n') %}{% endif %}",
    "{% else %}{% set ns = namespace(text='') %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{% set ns.text = ns.text + ('\n' if ns.text else '') + part['text'] %}"
    "{% elif part['type'] in ('image', 'image_url') %}{% set ns.text = ns.text + '<image>' %}{% endif %}"
    "{% endfor %}{% set content = ns.text %}{% endif %}")
#: Side of the square picture the tiny vision tower sees, and its patches' side: (56 / 14)^2 = 16 tokens an image.
VISION_IMAGE_SIZE, VISION_PATCH = 56, 14


def build_vision(out: Path, *, seed: int = 0, vocab_size: int = 4096, max_len: int = 2048) -> Path:
    """A LLaVA-shaped vision-language model: a 2-layer CLIP vision tower (56x56 pictures in 14x14 patches: 16 image
    tokens each), a projector and the tiny Llama, random weights, with its processor (CLIP's image processor, the
    tiny tokenizer with an <image> token) and a chat template that places image parts. The weights are saved under
    the names vLLM's LLaVA loader reads (``vision_tower.vision_model.*``, as llava-hf's checkpoints have them)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out)
    with _model_dir(out) as tmp:
        tok = build_tokenizer(tmp, seed, vocab_size)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
        tok.chat_template = VISION_CHAT_TEMPLATE
        tok.save_pretrained(str(tmp))
        eos = [tok.convert_tokens_to_ids("<|end_of_text|>"), tok.convert_tokens_to_ids("<|im_end|>")]
        text = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                           bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=VISION_IMAGE_SIZE, patch_size=VISION_PATCH, projection_dim=64)
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(
            "<image>"), vision_feature_select_strategy="default", vision_feature_layer=-1)
        config.dtype = "bfloat16"
        torch.manual_seed(seed)
        LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        weights = load_file(str(tmp / "model.safetensors"))
        save_file({("vision_tower.vision_model." + k[len("vision_tower."):]) if k.startswith("vision_tower.") else k: v
                   for k, v in weights.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        side = {"height": VISION_IMAGE_SIZE, "width": VISION_IMAGE_SIZE}
        images = CLIPImageProcessor(size={"shortest_edge": VISION_IMAGE_SIZE}, crop_size=side)
        # num_additional_image_tokens: CLIP's class token, which the "default" strategy drops again
        LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=VISION_PATCH,
                       chat_template=VISION_CHAT_TEMPLATE, vision_feature_select_strategy="default",
                       image_token="<image>", num_additional_image_tokens=1).save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                                "eos_token_id": eos}, indent=2))
    return out


def whisper_special_tokens() -> list[str]:
    """Whisper's special tokens, as its tokenizer names them: the end, the start, a token per language (the
    ISO-639-1 codes spark_llm's transcriptions endpoint accepts), the tasks, the previous text, no speech, no
    timestamps."""
    from spark_llm.endpoints.transcriptions import LANGUAGES

    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in sorted(LANGUAGES)]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>"])


def build_whisper(out: Path, *, seed: int = 0, vocab_size: int = 2048) -> Path:
    """A Whisper-shaped speech-to-text model, random weights: a one-layer encoder over 80 log-mel bins (30 s clips
    at 16 kHz, 1,500 positions), a one-layer decoder of 448 positions, width 64, and its processor (Whisper's feature
    extractor, a byte-level BPE trained here with Whisper's special tokens), which vLLM's Whisper loads. Its weights
    are drawn wide (std 0.3): at Whisper's 0.02 the decoder writes one token whatever it hears, and the tests could
    not tell whether the audio reached the encoder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
                              WhisperProcessor, WhisperTokenizerFast)

    out = Path(out)
    special = whisper_special_tokens()
    with _model_dir(out) as tmp:
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(_corpus(seed), trainer=trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        end = special[0]
        tok = WhisperTokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end, unk_token=end, pad_token=end,
                                   additional_special_tokens=special[1:], model_max_length=448)
        WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok).save_pretrained(
            str(tmp))
        end_id, start_id = tok.convert_tokens_to_ids(end), tok.convert_tokens_to_ids("<|startoftranscript|>")
        config = WhisperConfig(vocab_size=len(tok), num_mel_bins=80, encoder_layers=1, decoder_layers=1, d_model=64,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                               pad_token_id=end_id, bos_token_id=end_id, eos_token_id=end_id,
                               decoder_start_token_id=start_id, begin_suppress_tokens=None, suppress_tokens=None,
                               init_std=0.3)
        torch.manual_seed(seed)
        WhisperForConditionalGeneration(config).save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": end_id, "eos_token_id": end_id, "decoder_start_token_id": start_id}, indent=2))
    return out


def _quiet() -> None:
    """This command's console: the line it prints per model, without transformers' progress bars and its load
    report of the heads a classifier adds (random weights are what a tiny model is made of)."""
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="model directory to create (replaced if it exists)")
    p.add_argument("--kind", choices=["llm", "lora", "embedding", "classifier", "cross-encoder", "vision", "whisper"],
                   default="llm",
                   help="llm: the tiny Llama; lora: a LoRA adapter for the tiny Llama given by --base; embedding: a "
                        "sentence-transformers embedding model of it; classifier: a moderation classifier of it "
                        "(OpenAI's categories as labels); cross-encoder: a one-label relevance scorer of it (score, "
                        "rerank); vision: a LLaVA-shaped vision-language model around a tiny Llama; whisper: a "
                        "Whisper-shaped speech-to-text model (transcriptions, translations)")
    p.add_argument("--base", help="with --kind lora, embedding, classifier or cross-encoder: the tiny Llama's "
                                  "directory (built first when not given, but for lora)")
    p.add_argument("--seed", type=int, default=0, help="seed for the corpus, the tokenizer and the weights")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size to train")
    p.add_argument("--max-len", type=int, default=2048, help="max_position_embeddings of the model")
    p.add_argument("--if-stale", action="store_true", help="do nothing when --out already holds this version's model")
    args = p.parse_args(argv)
    _quiet()
    if args.kind == "lora":
        if not args.base:
            p.error("--kind lora needs --base (the tiny Llama's directory)")
        print(f"tiny LoRA adapter written to {build_lora(Path(args.base), Path(args.out), seed=args.seed + 1)}")
        return 0
    if args.kind == "embedding":
        with tempfile.TemporaryDirectory() as scratch:
            base = Path(args.base) if args.base else build_model(Path(scratch) / "llm", seed=args.seed,
                                                                 vocab_size=args.vocab_size, max_len=args.max_len)
            print(f"tiny embedding model written to {build_embedding(base, Path(args.out))}")
        return 0
    marker = Path(args.out) / "tiny_model_version"
    if args.if_stale and marker.exists() and marker.read_text().strip() == str(VERSION):
        print(f"tiny model in {args.out} is up to date")
        return 0
    if args.kind in ("classifier", "cross-encoder"):
        with tempfile.TemporaryDirectory() as scratch:
            base = Path(args.base) if args.base else build_model(Path(scratch) / "llm", seed=args.seed,
                                                                 vocab_size=args.vocab_size, max_len=args.max_len)
            out = build_classifier(base, Path(args.out), seed=args.seed, cross_encoder=args.kind == "cross-encoder")
            print(f"tiny {args.kind} written to {out}")
        return 0
    if args.kind == "whisper":
        print(f"tiny speech-to-text model written to {build_whisper(Path(args.out), seed=args.seed)}")
        return 0
    if args.kind == "vision":
        out = build_vision(Path(args.out), seed=args.seed, vocab_size=args.vocab_size, max_len=args.max_len)
        print(f"tiny vision-language model written to {out}")
        return 0
    out = build_model(Path(args.out), seed=args.seed, vocab_size=args.vocab_size, max_len=args.max_len)
    print(f"tiny model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
