"""Reports a person reads: folded tables within 100 columns, the hardware verdict, the analytic
step time, the OOM explainer and plots (all analytic: nothing here compiles a train step)."""

import io
import math
import re

import pytest
from conftest import require_devices

from t5lite.cli.main import main
from t5lite.insight import estimate, explain, hardware, tables
from t5lite.insight import report as rep
from t5lite.insight.communication import analytic_communication
from t5lite.insight.flops import transformer_train_flops
from t5lite.insight.memory import predict_memory
from t5lite.insight.sharding import format_bytes, sharding_report
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.model.network import DecoderOnlyConfig, T5Config
from t5lite.partitioning import (
    Partitioner,
    create_mesh,
    data_parallel_logical_axis_rules,
    preset_rules,
)
from t5lite.trainer import Trainer


def tiny_lm(**kw):
    cfg = DecoderOnlyConfig(vocab_size=128, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                            num_layers=12, **kw)  # fmt: skip
    return DecoderOnlyModel(network_config=cfg)


# --- tables -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _a_100_column_terminal(monkeypatch):
    # Reports wrap at the terminal's width (at most 100): the same text whatever runs the tests.
    monkeypatch.setenv("COLUMNS", "100")


def test_natural_order_folding_and_path_shortening():
    names = ["layers_10/a", "layers_2/a", "layers_1/a"]
    assert sorted(names, key=tables.natural_key) == ["layers_1/a", "layers_2/a", "layers_10/a"]
    assert tables.layer_pattern("decoder/layers_12/mlp/wi_0") == ("decoder/layers_{}/mlp/wi_0", 12)
    assert tables.layer_pattern("mlp/wi_0") == ("mlp/wi_0", None)
    assert tables.fold_indices([3, 0, 2, 1]) == "0..3" and tables.fold_indices([0, 2]) == "0,2"
    short = tables.shorten_path("decoder/layers_0..23/encoder_decoder_attention/key/kernel", 40)
    assert len(short) <= 40 and short.startswith("decoder/layers_0..23/")
    assert short.endswith("/key/kernel")


def test_sharding_table_folds_identical_layers_in_natural_order():
    require_devices(8)
    part = Partitioner(create_mesh(4), logical_axis_rules=preset_rules("megatron"))
    tr = Trainer(tiny_lm(), part, batch_size=8, lengths={"targets": 8})
    report = sharding_report(part, tr.abstract_state().params, tr.params_axes)
    folded = report.format(width=100, fold=True)
    assert max(map(len, folded.splitlines())) <= 100
    # 12 layers: one row each for the layers' arrays, the count beside it.
    assert "layers_0..11/mlp/wi_0/kernel" in folded and "×12" in folded
    assert "layers_1/" not in folded
    wide = report.format()
    rows = [line.split()[0] for line in wide.splitlines() if "/mlp/wi_0/kernel" in line]
    assert rows[:3] == [f"decoder/layers_{i}/mlp/wi_0/kernel" for i in (0, 1, 2)]
    assert rows[-1] == "decoder/layers_11/mlp/wi_0/kernel" and len(rows) == 12


def test_t5_xxl_report_fits_100_columns_and_names_a_verdict_for_v5p():
    """The XXL report, analytic (nothing compiled or allocated), on 8 devices under FSDP."""
    require_devices(8)
    cfg = T5Config(emb_dim=4096, num_heads=64, mlp_dim=10240, num_encoder_layers=24,
                   num_decoder_layers=24, dtype="bfloat16")  # fmt: skip
    part = Partitioner(create_mesh(8), logical_axis_rules=preset_rules("fsdp"))
    out = io.StringIO()
    sharding, step = rep.inspect(model=EncoderDecoderModel(network_config=cfg),
                                 task_feature_lengths={"inputs": 512, "targets": 114},
                                 batch_size=8, partitioner=part, device="v5p", compile=False,
                                 stream=out, progress=io.StringIO())  # fmt: skip
    text = out.getvalue()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert lines[0].startswith("summary")
    total = step.predicted.total
    assert total < 95 * 2**30  # 11.1e9 parameters + AdamW over 8 chips of 95 GiB
    verdict = (f"verdict: FITS on TPU v5: {format_bytes(total)} per device (predicted) of "
               f"95.00 GiB HBM, {100 * total / (95 * 2**30):.0f}%")  # fmt: skip
    flat = " ".join(text.split())  # the summary wraps at the terminal's width (at most 100)
    assert verdict in flat
    assert "step estimate:" in flat and "MFU ≈" in flat
    assert "TPU v5 figures: https://cloud.google.com/tpu/docs/v5p-training (459 TFLOPs" in flat
    assert "layers_0..23" in text and "×24" in text
    assert sharding.num_parameters == 11_135_332_352


# --- hardware and the analytic step -----------------------------------------------------------


def test_device_table_names_sources_and_rejects_unknown_names(capsys):
    for chip in hardware.CHIPS.values():
        # Every entry names the vendor page it was read from, with the figures as printed there.
        assert chip.source.startswith(("https://cloud.google.com/tpu/docs/", "https://www.nvidia"))
        assert chip.hbm_bytes_per_s > 0
        # ... and the peak as printed there: dense, or twice that with 2:4 sparsity (NVIDIA).
        m = re.search(r"([\d,.]+) TFLOPs? bf16( with sparsity)?", chip.source, re.I)
        quoted = float(m.group(1).replace(",", "")) / (2 if m.group(2) else 1)
        assert chip.peak_flops == pytest.approx(quoted * 1e12, rel=1e-3), chip
        assert hardware.device_spec_of_kind(chip.device_kind).source == chip.source
    assert hardware.chip_named("A100").name == "a100-80gb"
    assert hardware.device_spec_named("v5p").memory_bytes == 95 * 2**30
    with pytest.raises(ValueError, match="known: v4, v5e, v5p, v6e"):
        hardware.chip_named("v9")
    assert main(["inspect", "--gin_file=inspect.gin", "--device=v9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "t5lite inspect: error: --device='v9' is not a known device; known: v4, v5e, v5p, "
        "v6e, a100-40gb, a100-80gb, h100, h200, a100"
    ]


def test_step_estimate_hand_computed_for_data_parallel():
    require_devices(8)
    model = tiny_lm()
    part = Partitioner(create_mesh(1), logical_axis_rules=data_parallel_logical_axis_rules())
    tr = Trainer(model, part, batch_size=16, lengths={"targets": 8})
    report = sharding_report(part, tr.abstract_state().params, tr.params_axes)
    predicted = predict_memory(tr)
    spec = hardware.device_spec_named("v5e")
    e = estimate.estimate_step(tr, predicted, analytic_communication(tr, report), report, spec)
    flops = 16 * transformer_train_flops(model.network_config, 0, 8) / 8
    assert e.model_flops == pytest.approx(flops) and e.hardware_flops == pytest.approx(flops)
    # Data parallel: one ring all-reduce of every gradient over 8 devices, 2 * 7/8 of them.
    assert e.link_bytes == pytest.approx(2 * 7 / 8 * report.bytes_total)
    assert e.compute_s == pytest.approx(flops / 197e12)
    assert e.communication_s == pytest.approx(e.link_bytes / 200e9)
    hbm = 2 * (predicted.state + predicted.gradients + predicted.update + predicted.activations)
    assert e.hbm_s == pytest.approx(hbm / 819e9)
    step = max(e.compute_s, e.hbm_s) + e.communication_s
    assert e.step_s == pytest.approx(step)
    assert e.mfu(197e12) == pytest.approx(flops / step / 197e12)
    full = Trainer(tiny_lm(remat_policy="full"), part, batch_size=16, lengths={"targets": 8})
    e_full = estimate.estimate_step(full, predicted, analytic_communication(full, report),
                                    report, spec)  # fmt: skip
    assert e_full.hardware_flops == pytest.approx(4 / 3 * flops)  # the forward runs twice


# --- what does not fit ----------------------------------------------------------------------


def test_activations_by_layer_kind_hand_computed_and_add_up():
    """An unscanned decoder-only model, data parallel on 8 devices (one row per device, fp32):
    each kind of layer's buffers at the backward's peak, counted by hand."""
    require_devices(8)
    cfg = DecoderOnlyConfig(vocab_size=64, emb_dim=8, num_heads=2, num_kv_heads=2, head_dim=4,
                            mlp_dim=16, num_layers=2, scan_layers=False)  # fmt: skip
    part = Partitioner(create_mesh(1), logical_axis_rules=data_parallel_logical_axis_rules())
    tr = Trainer(DecoderOnlyModel(network_config=cfg), part, batch_size=8,
                 lengths={"targets": 16})  # fmt: skip
    p = predict_memory(tr)
    x, q, h, logits = 16 * 8 * 4, 16 * 2 * 4 * 4, 16 * 16 * 4, 16 * 64 * 4  # [1, L, ...] fp32
    kv, scores = 2 * q, 2 * 16 * 16 * 4  # k and v; [1, H, L, L] fp32
    per_layer = {"attention": 2 * q + kv + 2 * scores, "mlp": 5 * h,
                 "norms+residual": 3 * 2 * x}  # fmt: skip
    assert dict(p.activation_kinds) == {
        "attention": 2 * per_layer["attention"],
        "mlp": 2 * per_layer["mlp"],
        "norms+residual": 2 * per_layer["norms+residual"] + 3 * x,  # + the last layer's
        # logits and softmax: with the table replicated (data parallel) XLA writes its
        # gradient without a transposed cotangent buffer
        "logits+loss": 2 * logits,
    }
    assert sum(n for _, n in p.activation_kinds) == p.activations > p.update == 0
    text = rep.step_report(tr, compile=False).format(width=None)
    kinds = ", ".join(f"{k} {format_bytes(n)}" for k, n in p.activation_kinds)
    assert f"activations by layer kind: {kinds}" in text


def test_oom_explainer_names_buffers_and_predicts_each_fix():
    require_devices(8)
    model = tiny_lm()
    part = Partitioner(create_mesh(2), logical_axis_rules=preset_rules("megatron"))
    tr = Trainer(model, part, batch_size=16, lengths={"targets": 8})
    predicted = predict_memory(tr).total
    out = io.StringIO()
    _, step = rep.inspect(model=model, task_feature_lengths={"targets": 8}, batch_size=16,
                          partitioner=part, device_memory_gib=0.5 * predicted / 2**30,
                          compile=False, stream=out, progress=io.StringIO())  # fmt: skip
    text = out.getvalue()
    assert "verdict: DOES NOT FIT" in text
    assert f"why it does not fit: {format_bytes(predicted)} (predicted) >" in text
    # The largest parameters, by path with shape and logical axes (12 layers folded).
    assert "decoder/layers_0..11/mlp/wi_0/kernel 32x64 (embed,mlp)" in text
    assert "largest optimizer state per device:" in text
    # Each suggestion's figure is predict_memory of the changed layout.
    full = Trainer(tiny_lm(remat_policy="full"), part, batch_size=16, lengths={"targets": 8})
    assert f"remat_policy='full': {format_bytes(predict_memory(full).total)}" in text
    fsdp = Trainer(model, Partitioner(create_mesh(2), logical_axis_rules=preset_rules("fsdp")),
                   batch_size=16, lengths={"targets": 8})  # fmt: skip
    assert f"fsdp rules (2D parameters): {format_bytes(predict_memory(fsdp).total)}" in text
    more = Trainer(model, Partitioner(create_mesh(4), logical_axis_rules=preset_rules("megatron")),
                   batch_size=16, lengths={"targets": 8})  # fmt: skip
    assert f"model=4 (data=2): {format_bytes(predict_memory(more).total)}" in text
    s = {x.change: x for x in explain.suggestions(tr)}
    half = Trainer(model, part, batch_size=8, lengths={"targets": 8})
    p, p_half = predict_memory(tr), predict_memory(half)
    want = p_half.total + p.gradients + p.batch - p.batch // 2
    assert s["num_microbatches=2"].predicted == want
    assert math.isclose(step.predicted.total, predicted)


# --- plots ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_is_written(tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    require_devices(8)
    part = Partitioner(create_mesh(2), logical_axis_rules=preset_rules("fsdp"))
    path = tmp_path / f"chart{suffix}"
    out = io.StringIO()
    rep.inspect(model=tiny_lm(), task_feature_lengths={"targets": 8}, batch_size=16,
                partitioner=part, compile=False, plot=str(path), stream=out,
                progress=io.StringIO())  # fmt: skip
    assert path.read_bytes().startswith(magic)
    assert f"plot: {path}" in out.getvalue()


def test_plot_needs_matplotlib_and_a_known_format(monkeypatch, capsys):
    from t5lite.insight import plot

    with pytest.raises(ValueError, match=r"must end in \.png or \.svg"):
        plot.check_plot_path("chart.pdf")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    assert main(["inspect", "--gin_file=inspect.gin", "--plot=/tmp/x.png"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ('t5lite inspect: error: plotting needs matplotlib, the [plot] extra: '
                   'pip install -e ".[plot]"')  # fmt: skip
