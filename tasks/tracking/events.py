"""The lab's own scalars beside verl's in TensorBoard: a box's GSM8K score of the base model and of its
trained export, its plan's predicted GPU peak and the peak verl measured, written as a TensorBoard event
file (pure, standard library; the controller writes it, the lab's TensorBoard serves it).

The format is TensorBoard's: TFRecord framing (little-endian length, masked CRC-32C of it, the bytes, their
masked CRC-32C) around ``tensorflow.Event`` protocol buffers (``wall_time`` = 1, ``step`` = 2,
``file_version`` = 3, ``summary`` = 5; ``Summary.Value``: ``tag`` = 1, ``simple_value`` = 2,
``metadata`` = 9, ``tensor`` = 8), as ``tensorboard/compat/proto/event.proto`` and ``summary.proto`` define
them. tests/unit/test_tracking_hub.py reads what this writes with TensorBoard's own loader.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable

TAG_PREFIX = "verl_lab"
SCORE_TAG = f"{TAG_PREFIX}/gsm8k_accuracy"            # step 0: the base model; step N: the export of step N
PREDICTED_TAG = f"{TAG_PREFIX}/predicted_peak_mib"     # the plan's prediction
MEASURED_TAG = f"{TAG_PREFIX}/measured_peak_mib"       # verl's max_memory_allocated, from the console log
TEXT_TAG = f"{TAG_PREFIX}/summary"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _event(wall_time: float, step: int = 0, *, file_version: str | None = None, values: Iterable[bytes] = ()) -> bytes:
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes(3, file_version.encode())
    summary = b"".join(_bytes(1, v) for v in values)
    if summary:
        out += _bytes(5, summary)
    return out


def scalar_value(tag: str, value: float) -> bytes:
    return _bytes(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(value)))


def text_value(tag: str, text: str) -> bytes:
    """A text summary as TensorBoard's text plugin reads it: a scalar DT_STRING tensor, plugin "text"."""
    plugin = _bytes(1, _bytes(1, b"text"))                     # SummaryMetadata.plugin_data.plugin_name
    tensor = _field(1, 0, _varint(7)) + _bytes(2, b"") + _bytes(8, text.encode())   # DT_STRING, shape [], string_val
    return _bytes(1, tag.encode()) + _bytes(9, plugin) + _bytes(8, tensor)


def summary_points(summary: dict) -> list[tuple[int, str, float]]:
    """(step, tag, value) of a box's summary: ``{"gsm8k": tasks.status.gsm8k_summary(...),
    "predicted_peak_mib", "peak_mib", "step"}``."""
    points: list[tuple[int, str, float]] = []
    g = summary.get("gsm8k") or {}
    if g.get("base") is not None:
        points.append((0, SCORE_TAG, g["base"]))
    if g.get("trained") is not None and g.get("step") is not None:
        points.append((int(g["step"]), SCORE_TAG, g["trained"]))
    if summary.get("predicted_peak_mib") is not None:
        points.append((0, PREDICTED_TAG, summary["predicted_peak_mib"]))
    if summary.get("peak_mib") is not None:
        points.append((int(summary.get("step") or 0), MEASURED_TAG, summary["peak_mib"]))
    return sorted(points)


def summary_text(host: str, summary: dict) -> str:
    g = summary.get("gsm8k") or {}
    fmt = lambda v, spec="": "-" if v is None else format(v, spec)  # noqa: E731
    return (f"**{host}**: GSM8K accuracy {fmt(g.get('base'), '.3f')} (base model) -> {fmt(g.get('trained'), '.3f')} "
            f"(export of step {fmt(g.get('step'))}{'' if g.get('final') else ', not final'}); "
            f"GPU peak {fmt(summary.get('peak_mib'))} MiB measured, {fmt(summary.get('predicted_peak_mib'))} MiB "
            "predicted by the plan")


def summary_digest(summary: dict) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()[:12]


def summary_events(host: str, summary: dict, wall_time: float) -> bytes:
    """The event file's bytes: the version record, the scalars, the text."""
    out = record(_event(wall_time, file_version="brain.Event:2"))
    for step, tag, value in summary_points(summary):
        out += record(_event(wall_time, step, values=[scalar_value(tag, value)]))
    out += record(_event(wall_time, 0, values=[text_value(TEXT_TAG, summary_text(host, summary))]))
    return out


def summary_file_name(host: str, summary: dict, wall_time: float) -> str:
    """TensorBoard reads files whose name holds ``tfevents``; the digest names what the file says."""
    return f"events.out.tfevents.{int(wall_time)}.{host}.verl-lab.{summary_digest(summary)}"
