"""Audio files in requests (transcriptions, translations): how long one is, from its header, and its samples for
the engine, decoded there only.

An audio file is read where images are read from (:func:`~spark_llm.media.read_media` with
:data:`~spark_llm.media.AUDIO`), measured where the prompt tokens are counted (:func:`measure`: its format and
length, without decoding it; a file longer than its model hears at once is ``audio_too_large``), and decoded once,
in the engine process (:func:`decode_clip`): mono float samples at the model's rate, which vLLM's Whisper turns
into its log-mel features.

WAV (PCM) is read by the standard library everywhere; FLAC, OGG and MP3 where ``soundfile`` is installed (vLLM's
``audio`` extra installs it). A file is resampled to the model's rate here, with NumPy's FFT (band-limited, as
``scipy.signal.resample``), so the engine needs none of vLLM's optional resamplers.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import wave
from typing import Any, NamedTuple

from .engine_host.protocol import AudioClip
from .errors import ErrorCode, RequestError

#: What a file's first bytes say it is (the formats ``soundfile`` reads beside WAV).
_MAGIC = ((b"fLaC", "FLAC"), (b"OggS", "OGG"), (b"ID3", "MP3"), (b"\xff\xfb", "MP3"), (b"\xff\xf3", "MP3"),
          (b"\xff\xf2", "MP3"))


class AudioInfo(NamedTuple):
    """An audio file's format and length, from its header."""

    format: str
    seconds: float
    sample_rate: int
    channels: int


class Hearing(NamedTuple):
    """How a speech-to-text model hears (its feature extractor's settings): the rate it takes samples at, the
    samples per feature frame, and the longest clip it hears at once (Whisper: 16 kHz, 160, 30 s)."""

    sample_rate: int
    hop_length: int
    max_seconds: float

    def tokens(self, seconds: float) -> int:
        """What a clip of ``seconds`` costs the encoder, as vLLM counts it for Whisper: its log-mel frames."""
        return math.ceil(seconds * self.sample_rate / self.hop_length)


@functools.lru_cache(maxsize=None)
def hearing(model_dir: str) -> "Hearing | None":
    """How the model in ``model_dir`` hears, from its processor's settings (``preprocessor_config.json``, or the
    ``feature_extractor`` of ``processor_config.json`` as transformers 5 writes it); None for a model without a
    feature extractor for audio."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "feature_extractor")):
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        data = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(data, dict) and data.get("sampling_rate") and data.get("hop_length"):
            return Hearing(int(data["sampling_rate"]), int(data["hop_length"]), float(data.get("chunk_length") or 30))
    return None


def measure(data: bytes, where: str = "audio file") -> AudioInfo:
    """The format and length of the audio file ``data``, from its header; not audio, a format this process cannot
    read, or a header that does not parse is the request's error."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            with wave.open(io.BytesIO(data)) as w:
                rate, frames, channels = w.getframerate(), w.getnframes(), w.getnchannels()
        except (wave.Error, EOFError) as exc:
            if "unknown format" in str(exc):  # float or compressed samples: the standard library reads PCM only
                raise RequestError(ErrorCode.INVALID_AUDIO_FORMAT, f"{where} is a WAV file of samples other than "
                                                                   f"PCM integers ({exc}); send 16-bit PCM WAV, FLAC "
                                                                   f"or MP3") from None
            raise _broken(where, exc) from None
        if not rate or not channels:
            raise _broken(where, ValueError(f"{rate} Hz, {channels} channels"))
        return AudioInfo("WAV", frames / rate, rate, channels)
    fmt = next((name for magic, name in _MAGIC if data.startswith(magic)), None)
    if fmt is None:
        raise RequestError(ErrorCode.INVALID_AUDIO_FORMAT, f"{where} is not an audio file (its {len(data):,} bytes "
                                                           f"start {data[:8]!r}); send WAV, FLAC, OGG or MP3")
    sf = _soundfile(fmt, where)
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - libsndfile's errors vary by format
        raise _broken(where, exc) from None
    return AudioInfo(fmt, float(info.duration), int(info.samplerate), int(info.channels))


def decode_clip(clip: AudioClip, where: str = "audio file") -> tuple[Any, int]:
    """The samples of an :class:`~spark_llm.engine_host.protocol.AudioClip` as vLLM takes them: mono float32 at
    the clip's rate, and that rate. Engine side; a file that does not decode is the request's
    ``audio_parse_error``."""
    import numpy as np

    info = measure(clip.data, where)
    try:
        if info.format == "WAV":
            samples = _wav_samples(clip.data)
        else:
            samples, _ = _soundfile(info.format, where).read(io.BytesIO(clip.data), dtype="float32", always_2d=True)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _broken(where, exc) from None
    mono = samples.mean(axis=1) if samples.ndim == 2 else samples
    return resample(np.asarray(mono, dtype=np.float32), info.sample_rate, clip.sample_rate), clip.sample_rate


def _wav_samples(data: bytes) -> Any:
    """A PCM WAV file's samples in [-1, 1], one column per channel."""
    import numpy as np

    with wave.open(io.BytesIO(data)) as w:
        width, channels, raw = w.getsampwidth(), w.getnchannels(), w.readframes(w.getnframes())
    if width == 1:  # 8-bit WAV is unsigned
        values = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0
    elif width == 3:  # 24-bit: little-endian triplets, widened to 32 bits
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8).astype(np.float32)
    else:
        values = np.frombuffer(raw, dtype={2: "<i2", 4: "<i4"}[width]).astype(np.float32)
    return (values / float(1 << (8 * width - 1))).reshape(-1, channels)


def resample(samples: Any, rate: int, target: int) -> Any:
    """``samples`` at ``rate`` resampled to ``target`` through the FFT (band-limited: nothing above the lower
    rate's Nyquist frequency is kept, so downsampling does not alias)."""
    import numpy as np

    if rate == target or len(samples) == 0:
        return samples
    n = max(int(round(len(samples) * target / rate)), 1)
    spectrum = np.fft.rfft(samples)
    keep = n // 2 + 1
    spectrum = spectrum[:keep] if len(spectrum) >= keep else np.pad(spectrum, (0, keep - len(spectrum)))
    return (np.fft.irfft(spectrum, n) * (n / len(samples))).astype(np.float32)


def _soundfile(fmt: str, where: str) -> Any:
    try:
        import soundfile
    except ImportError:
        raise RequestError(ErrorCode.INVALID_AUDIO_FORMAT,
                           f"{where} is {fmt}, which this cluster cannot read: send WAV, or install soundfile on "
                           f"the executors (pip install soundfile)") from None
    return soundfile


def _broken(where: str, exc: BaseException) -> RequestError:
    return RequestError(ErrorCode.AUDIO_PARSE_ERROR, f"{where} is a broken audio file: {type(exc).__name__}: "
                                                     f"{str(exc)[:200]}")
