"""`specdec bench --suite roofline`: the gguf engine's kernels against the machine's own ceilings.

For each product kernel the model runs (its formats and shapes, counted per pass), for the kernels of the other
formats on a weight of the model's largest shape, for the attention, the activations' quantization and the whole
pass, at row counts 1-16 and 64-512:
  - multiply-adds per second against the machine's measured int8 peak (bench/machine_peaks.c: vpdpbusd where the
    CPU has AVX512-VNNI, else AVX2's maddubs + madd + add), and for the attention against its float32 FMA peak;
  - weight bytes read per second against the measured memory bandwidth;
  - where a pass's time goes: products, output head, attention, quantization of activations, the rest of a layer.
Times are medians of `repeats` after a warm-up; each row count's measurements run in turn across the items, so the
machine's drift falls on all of them alike. Writes report.md, results.json and roofline.png.
"""

import json
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from specdec.bench.runner import machine_description
from specdec.common.models import load_model
from specdec.common.quantized.decoder import StackedProducts
from specdec.common.quantized.formats import pack
from specdec.common.quantized.kernels import kernels
from specdec.common.quantized.layers import QuantizedLinear

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 64, 128, 256, 512)
QUICK_ROWS = (1, 2, 4, 8, 16, 64)
CONTEXT = 160
# Formats with a kernel that a model may lack: measured on a weight of the model's largest product shape.
OTHER_FORMATS = (Q.Q8_0, Q.Q5_0, Q.Q4_1)
PEAKS_SOURCE = Path(__file__).with_name("machine_peaks.c")


@dataclass
class RooflineConfig:
    name: str
    target_model: str = "qwen2.5-coder-1.5b"
    quick: bool = False
    repeats: int = 5
    rows: list[int] = field(default_factory=lambda: list(ROWS))
    output_root: str = "bench/results"

    def __post_init__(self):
        if self.quick:
            self.repeats, self.rows = 2, [r for r in self.rows if r in QUICK_ROWS]


def machine_peaks(threads: int, scale: float = 1.0) -> dict:
    """The machine's int8 multiply-add, float32 FMA and memory read peaks, for 1 thread and for `threads` (scale:
    the work of each measurement, 1 for the suite's)."""
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "machine_peaks"
        subprocess.run(["cc", "-O3", "-fopenmp", str(PEAKS_SOURCE), "-o", str(binary)], check=True)
        return json.loads(
            subprocess.run([str(binary), str(threads), str(scale)], check=True, capture_output=True, text=True).stdout
        )


@dataclass
class Product:
    """One product shape of the pass: a kernel on an [n, k] weight, `calls` times a pass."""

    name: str
    linear: QuantizedLinear
    calls: int

    @property
    def macs_per_row(self) -> int:
        return self.linear.out_features * self.linear.in_features

    @property
    def weight_bytes(self) -> int:
        return self.linear.packed.nbytes


def layer_products(model) -> list[Product]:
    """The products one pass runs (q/k/v and gate/up stacked as the decoder stacks them), one per kernel and shape,
    with how many times a pass calls it; the output head last."""
    found: dict[tuple, QuantizedLinear] = {}
    calls: Counter = Counter()
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        stacked = [
            StackedProducts([attention.q_proj, attention.k_proj, attention.v_proj]),
            StackedProducts([mlp.gate_proj, mlp.up_proj]),
        ]
        linears = [linear for products in stacked for linear, _ in products.calls] + [attention.o_proj, mlp.down_proj]
        for linear in linears:
            key = (linear.kernel, linear.out_features, linear.in_features)
            found.setdefault(key, linear)
            calls[key] += 1
    products = [Product(f"{kernel} {n}x{k}", found[kernel, n, k], count) for (kernel, n, k), count in calls.items()]
    head = model.get_output_embeddings()
    return [*products, Product(f"head {head.kernel} {head.out_features}x{head.in_features}", head, 1)]


def other_format_products(shape: tuple[int, int]) -> list[Product]:
    """The kernels of the formats the model lacks, on random weights of `shape` quantized by gguf's reference code."""
    n, k = shape
    weights = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.02
    products = []
    for qtype in OTHER_FORMATS:
        packed = pack(quants.quantize(weights, qtype), qtype, n, k)
        products.append(Product(f"{qtype.name} {n}x{k} (random)", QuantizedLinear(packed), 0))
    return products


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def attention_call(config, rows: int, context: int):
    """One layer's attention for `rows` new rows of one session over `context` earlier positions."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    keys, values = torch.randn(1, kv_heads, context + rows, dim), torch.randn(1, kv_heads, context + rows, dim)
    ops = kernels()

    def call():
        ops.attend_sessions(q, k, v, [keys], [values], [context], [rows], dim**-0.5, 0, 0.0)  # no window, no soft cap

    # Multiply-adds: each row's scores and weighted sum, over its context and the pass's rows before it.
    macs = 2 * heads * dim * sum(context + i + 1 for i in range(rows))
    return call, macs


def pass_call(loaded, rows: int):
    """The model's whole pass over `rows` new tokens at a CONTEXT-token context (rolled back after)."""
    runner = loaded.runner
    cache = runner.new_cache()
    runner.forward([cache], [list(range(100, 100 + CONTEXT))], [1])

    def call():
        runner.forward([cache], [list(range(1000, 1000 + rows))], [1])
        runner.crop_to(cache, CONTEXT)

    return call


def measure(config: RooflineConfig, loaded, products: list[Product]) -> list[dict]:
    text = loaded.model.config.get_text_config()
    ops = kernels()
    layers = text.num_hidden_layers
    rows_out = []
    for rows in config.rows:
        measured = {}
        for product in products:
            x = torch.randn(rows, product.linear.in_features)
            measured[product.name] = timed(lambda p=product, x=x: p.linear.product(x), config.repeats)
        # The activations' quantization each product call starts with: blocks of 256 for the K-quants, else 32.
        shapes = sorted({(p.linear.in_features, 256 if p.linear.kernel in ("q4k", "q6k") else 32) for p in products})
        quantize_s = {
            shape: timed(lambda x=torch.randn(rows, shape[0]), b=shape[1]: ops.quantize_activations(x, b), config.repeats)
            for shape in shapes
        }
        attend, attend_macs = attention_call(text, rows, CONTEXT)
        attention_s = timed(attend, config.repeats)
        pass_s = timed(pass_call(loaded, rows), config.repeats)
        for product in products:
            seconds = measured[product.name]
            rows_out.append(
                dict(
                    item=product.name,
                    rows=rows,
                    ms=seconds * 1e3,
                    calls=product.calls,
                    macs_per_s=rows * product.macs_per_row / seconds,
                    bytes_per_s=product.weight_bytes / seconds,
                )
            )
        rows_out.append(
            dict(item="attention", rows=rows, ms=attention_s * 1e3, calls=layers, macs_per_s=attend_macs / attention_s)
        )
        for (k, block), seconds in quantize_s.items():
            rows_out.append(dict(item=f"quantize activations {k} (blocks of {block})", rows=rows, ms=seconds * 1e3))
        in_pass = [p for p in products if p.calls]
        products_ms = sum(measured[p.name] * p.calls for p in in_pass) * 1e3
        all_macs = rows * sum(p.macs_per_row * p.calls for p in in_pass)
        all_bytes = sum(p.weight_bytes * p.calls for p in in_pass)
        rows_out.append(
            dict(
                item="pass",
                rows=rows,
                ms=pass_s * 1e3,
                macs_per_s=all_macs / pass_s,
                bytes_per_s=all_bytes / pass_s,
                products_ms=products_ms,
                attention_ms=attention_s * layers * 1e3,
                rest_ms=pass_s * 1e3 - products_ms - attention_s * layers * 1e3,
            )
        )
    return rows_out


def with_shares(rows: list[dict], peaks: dict) -> list[dict]:
    """Each measurement as a share of the machine's peaks (all threads): int8 for products, FMA for attention."""
    top = peaks["all_threads"]
    for row in rows:
        if "macs_per_s" in row:
            peak = top["fma_flops"] / 2 if row["item"] == "attention" else top["int8_macs"]
            row["peak_share"] = row["macs_per_s"] / peak
        if "bytes_per_s" in row:
            row["bandwidth_share"] = row["bytes_per_s"] / top["read_bytes"]
    return rows


def table(rows: list[dict], items: list[str], row_counts: list[int], key: str, scale: float = 100.0, digits: int = 0) -> str:
    """A markdown table of one quantity: an item per line, a row count per column."""
    lines = ["| item | " + " | ".join(str(r) for r in row_counts) + " |", "|---" * (len(row_counts) + 1) + "|"]
    by = {(row["item"], row["rows"]): row for row in rows}
    for item in items:
        cells = [by.get((item, r), {}).get(key) for r in row_counts]
        lines.append(f"| {item} | " + " | ".join("-" if c is None else f"{c * scale:.{digits}f}" for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], items: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (share, breakdown) = plt.subplots(1, 2, figsize=(13, 5))
    for item in items:
        points = [(row["rows"], row["peak_share"] * 100) for row in rows if row["item"] == item and "peak_share" in row]
        if points:
            share.plot(*zip(*points, strict=True), marker="o", label=item)
    share.axhline(60, color="grey", linestyle="--", linewidth=1, label="60 % of the int8 peak")
    share.set(
        xscale="log", xlabel="activation rows in the call", ylabel="% of the machine's peak", title="kernels against the peak"
    )
    share.legend(fontsize=7)
    passes = [row for row in rows if row["item"] == "pass"]
    counts = [row["rows"] for row in passes]
    per_row = [[row[key] / row["rows"] for row in passes] for key in ("products_ms", "attention_ms", "rest_ms")]
    bottom = np.zeros(len(passes))
    for values, label in zip(per_row, ("products", "attention", "rest of the layers"), strict=True):
        breakdown.bar([str(c) for c in counts], values, bottom=bottom, label=label)
        bottom += np.array(values)
    breakdown.set(xlabel="rows in the pass", ylabel="ms per row", title="where a pass's time goes, per row")
    breakdown.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(config: RooflineConfig, rows: list[dict], peaks: dict, machine: dict) -> str:
    items = list(dict.fromkeys(row["item"] for row in rows))
    products = [i for i in items if i not in ("attention", "pass") and not i.startswith("quantize")]
    top = peaks["all_threads"]
    passes = [row for row in rows if row["item"] == "pass"]
    one = passes[0]["ms"] if passes and passes[0]["rows"] == 1 else None
    lines = [
        f"# Roofline of the gguf engine: {config.target_model}",
        "",
        f"Machine: {machine['processor']}, {machine['torch_threads']} threads, kernels on {kernels().isa()} "
        f"({kernels().numerics()}).",
        f"Peaks measured (bench/machine_peaks.c, {peaks['threads']} threads): int8 {top['int8_macs'] / 1e9:.0f} G "
        f"multiply-adds/s ({peaks['int8_isa']}; one thread {peaks['one_thread']['int8_macs'] / 1e9:.0f}), "
        f"float32 FMA {top['fma_flops'] / 1e9:.0f} GFLOP/s, "
        f"memory read {top['read_bytes'] / 1e9:.1f} GB/s.",
        "",
        "## Products: % of the int8 peak",
        "",
        table(rows, [*products, "attention", "pass"], config.rows, "peak_share"),
        "",
        "(attention: % of the float32 FMA peak; pass: all its products' multiply-adds over the pass's time.)",
        "",
        "## Products: % of the memory bandwidth (weight bytes read once per call)",
        "",
        table(rows, [*products, "pass"], config.rows, "bandwidth_share"),
        "",
        "## Milliseconds per call",
        "",
        table(rows, items, config.rows, "ms", scale=1.0, digits=2),
        "",
        "## The pass, per row",
        "",
        "| rows | pass ms | steps | ms per extra row | products ms | attention ms | rest ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in passes:
        steps = f"{row['ms'] / one:.2f}" if one else "-"
        extra = f"{(row['ms'] - one) / (row['rows'] - 1):.2f}" if one and row["rows"] > 1 else "-"
        parts = (row["products_ms"], row["attention_ms"], row["rest_ms"])
        lines.append(f"| {row['rows']} | {row['ms']:.1f} | {steps} | {extra} | " + " | ".join(f"{p:.1f}" for p in parts) + " |")
    lines += ["", "![roofline](roofline.png)", ""]
    return "\n".join(lines)


def run_roofline(config: RooflineConfig) -> Path:
    out = Path(config.output_root) / config.name
    out.mkdir(parents=True, exist_ok=True)
    peaks = machine_peaks(torch.get_num_threads())
    loaded = load_model(config.target_model, engine="gguf")
    products = layer_products(loaded.model)
    largest = max(products[:-1], key=lambda p: p.macs_per_row)
    products += other_format_products((largest.linear.out_features, largest.linear.in_features))
    rows = with_shares(measure(config, loaded, products), peaks)
    machine = machine_description()
    (out / "results.json").write_text(json.dumps(dict(config=asdict(config), machine=machine, peaks=peaks, rows=rows), indent=1))
    items = list(dict.fromkeys(row["item"] for row in rows if "peak_share" in row))
    plot(rows, items, out / "roofline.png")
    (out / "report.md").write_text(report(config, rows, peaks, machine))
    return out
