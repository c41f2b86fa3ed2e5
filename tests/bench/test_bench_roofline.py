"""`specdec bench --suite roofline`: it counts every multiply-add of a pass, measures the machine's peaks and writes
its tables and plot (no speed is asserted: speed goes to the bench's report)."""

import json

import pytest

from specdec.bench.roofline import RooflineConfig, layer_products, machine_peaks, run_roofline


def test_the_roofline_counts_every_multiply_add_of_a_pass(smollm2):
    config = smollm2.model.config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    qkv = hidden + 2 * config.num_key_value_heads * head_dim
    per_layer = hidden * qkv + hidden * hidden + 3 * hidden * config.intermediate_size
    products = layer_products(smollm2.model)
    *layer_calls, head = products
    assert sum(p.macs_per_row * p.calls for p in layer_calls) == layers * per_layer
    assert (head.calls, head.macs_per_row) == (1, config.vocab_size * hidden)
    # q, k and v are one call and gate and up another, as the decoder runs them: 4 calls a layer.
    assert sum(p.calls for p in layer_calls) == 4 * layers


def test_the_machine_peaks_are_measured_for_one_thread_and_all():
    peaks = machine_peaks(threads=2, scale=0.05)
    assert peaks["int8_isa"] in ("avx2", "avx512-vnni") and peaks["threads"] == 2
    for threads in ("one_thread", "all_threads"):
        assert set(peaks[threads]) == {"int8_macs", "fma_flops", "read_bytes"}
        assert all(value > 1e8 for value in peaks[threads].values()), peaks


@pytest.mark.slow
def test_the_roofline_suite_writes_its_tables_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr("specdec.bench.roofline.machine_peaks", lambda threads: machine_peaks(threads, scale=0.05))
    config = RooflineConfig(name="roofline", target_model="smollm2-135m", rows=[1, 2, 8], repeats=1, output_root=str(tmp_path))
    out = run_roofline(config)
    results = json.loads((out / "results.json").read_text())
    items = {row["item"] for row in results["rows"]}
    # Every product of the pass, the formats the model lacks, the attention, the quantization and the pass itself.
    assert {"attention", "pass"} <= items and any(i.startswith("head ") for i in items)
    assert {"Q8_0", "Q5_0", "Q4_1"} <= {i.split()[0] for i in items}
    assert any(i.startswith("quantize activations") for i in items)
    for row in results["rows"]:
        assert row["ms"] > 0 and row["rows"] in (1, 2, 8)
        if "macs_per_s" in row:
            assert row["peak_share"] > 0
    passes = [row for row in results["rows"] if row["item"] == "pass"]
    assert [row["rows"] for row in passes] == [1, 2, 8]
    assert all(row["products_ms"] > 0 and row["bandwidth_share"] > 0 for row in passes)
    report = (out / "report.md").read_text()
    for heading in ("% of the int8 peak", "% of the memory bandwidth", "Milliseconds per call", "The pass, per row"):
        assert heading in report
    assert (out / "roofline.png").stat().st_size > 0
