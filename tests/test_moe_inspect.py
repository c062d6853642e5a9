"""`inspect` on a mixture of experts: the compiled step's all-to-alls per MoE layer equal
GShard's dispatch and combine volume (t5lite/insight/experts.py), on 8 fake devices."""

from __future__ import annotations

import dataclasses
import io

import pytest
from conftest import require_devices
from moe_fixtures import LM_MOE, T5_MOE, moe_trainer
from readme_blocks import block, run

from t5lite import partitioning
from t5lite.insight import experts
from t5lite.insight import plan as plan_lib
from t5lite.insight.communication import collective_rows
from t5lite.insight.comparison import compare_communication
from t5lite.insight.hlo import parse_collectives
from t5lite.insight.report import step_report
from t5lite.model.models import DecoderOnlyModel

CASES = {
    # C = ceil(1.25 * 8 * 2 / 4) = 5 slots, padded to 6 over model=2: 1 x 8 x 3 x 16 floats.
    "lm": (LM_MOE, {"targets": 8}, [("decoder", 2, 1536, 768)]),
    # Top-1, S=12 / 8: C = 4 / 3 (padded to 4) over model=2 -> 1 x 8 x 2 x 16 floats.
    "t5": (
        T5_MOE,
        {"inputs": 12, "targets": 8},
        [("encoder", 1, 1024, 768), ("decoder", 1, 1024, 512)],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_all_to_alls_per_moe_layer_equal_gshard(case):
    require_devices(8)
    cfg, lengths, want = CASES[case]
    tr = moe_trainer(cfg, lengths=lengths)
    model = experts.expert_all_to_all(tr, ("data",))
    got = [(s.name, s.layers, s.dispatched_bytes, s.weights_grad_bytes) for s in model.stacks]
    assert got == want
    assert model.axes == ("data",) and model.group_size == 4
    hlo = tr.train_step.lower(tr.abstract_state(), tr.batch_abstract).compile().as_text()
    a2a = [c for c in parse_collectives(hlo, tr.partitioner.mesh) if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {("data",)}
    assert (len(a2a), sum(c.bytes for c in a2a)) == (model.count, model.bytes)
    assert model.count == 5 * sum(s.layers for s in model.stacks)
    rows = collective_rows(parse_collectives(hlo, tr.partitioner.mesh))
    lines = experts.format_expert_all_to_all(model, rows)
    assert lines[-1].endswith(": agrees"), lines


def test_inspect_report_prints_the_moe_all_to_alls():
    require_devices(8)
    tr = moe_trainer(dataclasses.replace(LM_MOE, num_layers=1))
    step = step_report(tr)
    text = step.format()
    assert "mixture of experts: GShard's all-to-alls over data (4 devices):" in text
    # Every axis's compiled bytes within 10% of the analytic model and its named choices.
    by_axes = {c.axes: c for c in compare_communication(step.collectives, step.analytic)}
    assert by_axes[("data",)].agrees and by_axes[("model",)].agrees, by_axes
    assert "  analytic: 5 all-to-alls, 6.75 KiB per step" in text
    assert "  compiled: 5 all-to-alls, 6.75 KiB: agrees" in text


def test_no_all_to_all_expected_without_expert_parallelism():
    require_devices(8)
    # Dropless sorts tokens globally (GSPMD gathers); data_parallel-style dense model: none.
    assert (
        experts.expert_all_to_all(
            moe_trainer(dataclasses.replace(LM_MOE, moe_dispatch="dropless")), ("data",)
        )
        is None
    )
    assert (
        experts.expert_all_to_all(
            moe_trainer(dataclasses.replace(LM_MOE, num_experts=0)), ("data",)
        )
        is None
    )


def test_plan_searches_and_ranks_the_expert_layouts():
    require_devices(8)
    out, progress = io.StringIO(), io.StringIO()
    ranked = plan_lib.plan(
        model=DecoderOnlyModel(network_config=LM_MOE),
        task_feature_lengths={"targets": 8},
        batch_size=8,
        num_devices=8,
        remat_policies=["none"],
        model_sizes=[1, 2],
        top_k=1,
        stream=out,
        progress=progress,
    )
    by_name = {(c.layout.preset, c.layout.data): c for c in ranked}
    # Every preset of presets_for(4), expert_parallel included, on every mesh it can take.
    assert {p for p, _ in by_name} == set(partitioning.presets_for(4))
    assert "expert_parallel" in partitioning.presets_for(4)
    assert "expert_parallel" not in partitioning.presets_for(0)
    # 4 experts over data=8 cannot be split: screened out in one line naming the setting.
    assert by_name[("data_parallel", 8)].status.startswith(
        "invalid: num_experts=4 is not divisible by mesh axes 'data' of size 8"
    )
    # The screen prices GShard's all-to-alls of the expert layout.
    ep = by_name[("expert_parallel", 4)]
    want = experts.expert_all_to_all(moe_trainer(LM_MOE), ("data",))
    got = [e for e in ep.analytic.communication.expected if e.kind == "all-to-all"]
    assert [(e.axes, e.count, e.bytes) for e in got] == [(("data",), want.count, want.bytes)]
    # Compiled candidates that fit come first, by compiled step time.
    fits = [c for c in ranked if c.fits]
    assert fits and ranked[: len(fits)] == fits
    assert [c.step_seconds for c in fits] == sorted(c.step_seconds for c in fits)
    assert f"best: {ranked[0].layout.name}" in out.getvalue()


def test_plan_compiles_and_ranks_expert_parallel_against_megatron():
    require_devices(8)
    ranked = plan_lib.plan(
        model=DecoderOnlyModel(network_config=LM_MOE),
        task_feature_lengths={"targets": 8},
        batch_size=8,
        num_devices=8,
        presets=["megatron", "expert_parallel"],
        remat_policies=["none"],
        model_sizes=[2],
        top_k=2,
        stream=io.StringIO(),
        progress=io.StringIO(),
    )
    assert [c.status for c in ranked] == ["fits", "fits"]
    assert ranked[0].step_seconds <= ranked[1].step_seconds
    ep = next(c for c in ranked if c.layout.preset == "expert_parallel")
    want = experts.expert_all_to_all(moe_trainer(LM_MOE), ("data",))
    assert ep.step.count("all-to-all", ("data",)) == want.count
    assert ep.step.bytes_over(("data",), "all-to-all") == want.bytes


def test_the_inspect_and_plan_commands_of_the_moe_page():
    out = run(block("docs/moe.md", "moe-inspect-plan"), timeout=1200)
    assert "mixture of experts: GShard's all-to-alls over data (4 devices):" in out.stdout
    assert "  compiled: 10 all-to-alls, 876.00 KiB: agrees" in out.stdout
    assert "expert_parallel data=4 model=2" in out.stderr  # plan screened the expert layout
    assert "best: " in out.stdout
