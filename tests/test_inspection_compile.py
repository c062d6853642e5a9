"""`inspect` and `plan` compile the train step only to read it: on CPU they compile with cheap
code generation (`report.INSPECTION_CPU_COMPILER_OPTIONS`), which must leave every figure they
read exactly as the optimised compile gives it."""

import re

from conftest import require_devices

from t5lite.insight import report as rep
from t5lite.insight.hlo import parse_collectives
from t5lite.insight.memory import memory_report
from t5lite.model.models import DecoderOnlyModel
from t5lite.model.network import DecoderOnlyConfig
from t5lite.partitioning import Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer


def _instructions(hlo: str) -> list[str]:
    return [
        re.sub(r", metadata=\{.*?\}", "", line)
        for line in hlo.splitlines()
        if line.strip() and not line.lstrip().startswith(("FileNames", "FunctionNames"))
    ]


def _fsdp_trainer() -> Trainer:
    # FSDP on data=4 x model=2: parameters all-gathered, gradients reduced, over both axes.
    cfg = DecoderOnlyConfig(
        vocab_size=128, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64, num_layers=2
    )
    part = Partitioner(create_mesh(2), logical_axis_rules=preset_rules("fsdp"))
    model = DecoderOnlyModel(network_config=cfg)
    return Trainer(model, part, batch_size=16, lengths={"targets": 8})


def test_inspection_compile_reads_the_same_figures_as_the_optimised_compile():
    require_devices(8)
    trainer = _fsdp_trainer()
    mesh = trainer.partitioner.mesh
    assert rep.inspection_compiler_options(mesh) == rep.INSPECTION_CPU_COMPILER_OPTIONS
    fast = rep.compile_train_step(trainer)  # what inspect and plan do
    full = rep.compile_train_step(trainer, for_inspection=False)  # what train does
    # The optimised HLO is the same: every instruction, with the source locations left out (a
    # program read from the on-disk compile cache names whichever process compiled it)...
    assert _instructions(fast.as_text()) == _instructions(full.as_text())
    collectives = parse_collectives(full.as_text(), mesh)
    assert collectives == parse_collectives(fast.as_text(), mesh)
    kinds = {c.kind for c in collectives}
    assert "all-gather" in kinds and len(kinds) >= 2, kinds
    # ... and so are buffer assignment's bytes and the cost analysis's FLOPs and bytes.
    assert memory_report(fast) == memory_report(full)
    assert memory_report(full).temporaries > 0
    cost_fast, cost_full = fast.cost_analysis(), full.cost_analysis()
    assert cost_full["flops"] > 0
    assert cost_fast["flops"] == cost_full["flops"]
    assert cost_fast["bytes accessed"] == cost_full["bytes accessed"]
    # The step reports inspect prints from them are equal field by field.
    assert rep.step_report(trainer, compiled=fast) == rep.step_report(trainer, compiled=full)
