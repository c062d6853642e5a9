"""`infer`: resumable JSONL output (interrupted runs finish with the same records), complete
outputs never overwritten, foreign outputs refused; predict and score modes."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import require_devices

import t5lite.programs.infer as infer_program
from t5lite.checkpoint import CheckpointManager
from t5lite.model import models, network
from t5lite.partitioning import Partitioner
from t5lite.programs import DataConfig
from t5lite.trainer import Trainer

LENGTHS = {"inputs": 8, "targets": 8}
BATCH = 8
N_EXAMPLES = 20  # 3 batches: 8, 8, 4
CFG = network.T5Config(
    vocab_size=384, emb_dim=16, num_heads=4, head_dim=4, mlp_dim=32,
    num_encoder_layers=1, num_decoder_layers=1,
)  # fmt: skip


def _model(**kwargs) -> models.EncoderDecoderModel:
    return models.EncoderDecoderModel(network_config=CFG, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_devices(8)
    d = tmp_path_factory.mktemp("infer_ckpt")
    trainer = Trainer(_model(), Partitioner(num_partitions=2), batch_size=BATCH, lengths=LENGTHS)
    ckpt = CheckpointManager(str(d))
    # NOTE: made non-zero: at the time of writing, a checkpointed all-zero array (the fresh
    # optimizer state) could not be read back ("chunk ... is missing"); infer only needs params.
    state = trainer.init_state()
    state = state.replace(
        step=state.step + 1, opt_state=jax.tree.map(lambda x: x + 1, state.opt_state)
    )
    ckpt.save(1, state)
    ckpt.close()
    return str(d)


def _infer(model_dir, out, model=None, **kwargs):
    data = DataConfig("synthetic_reverse", LENGTHS, BATCH, num_examples=N_EXAMPLES)
    return infer_program.infer(
        model_dir=model_dir, model=model or _model(), data=data, output_file=str(out),
        partitioner=Partitioner(num_partitions=2), **kwargs,
    )  # fmt: skip


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


class _Stop(Exception):
    pass


def _interrupt_after(monkeypatch, n_appends: int, torn: bool):
    """Makes infer stop (as a preemption would) after `n_appends` appended batches."""
    real = infer_program.append_records
    calls = []

    def append(path, records):
        calls.append(1)
        if len(calls) > n_appends:
            if torn:  # half a record reaches the disk, then the process dies
                with open(path, "a") as f:
                    f.write(json.dumps(records[0])[:17])
            raise _Stop
        real(path, records)

    monkeypatch.setattr(infer_program, "append_records", append)


@pytest.mark.parametrize("method", ["greedy", "sample"])
def test_interrupted_infer_resumes_to_the_same_output(model_dir, tmp_path, monkeypatch, method):
    model = _model(decoding_method=method, temperature=1.0)
    full = tmp_path / "full.jsonl"
    _infer(model_dir, full, model)
    want = _lines(full)
    assert len(want) == N_EXAMPLES
    assert set(json.loads(want[0])) == {"task", "inputs", "targets", "prediction"}

    part = tmp_path / "part.jsonl"
    _interrupt_after(monkeypatch, 1, torn=True)
    with pytest.raises(_Stop):
        _infer(model_dir, part, model)
    assert len(_lines(part)) == BATCH + 1  # one whole batch and a torn record
    monkeypatch.undo()
    _infer(model_dir, part, model)
    assert _lines(part) == want  # the same records, also when sampling (per-batch seeds)


def test_partial_batch_is_recomputed_and_complete_output_is_kept(model_dir, tmp_path, capsys):
    full = tmp_path / "full.jsonl"
    _infer(model_dir, full)
    want = _lines(full)
    assert f"infer: wrote {N_EXAMPLES} records to {full}\n" in capsys.readouterr().out
    # A file cut inside the second batch (as another writer might leave it): cut back to the
    # last whole batch and finished.
    part = tmp_path / "part.jsonl"
    part.write_text("\n".join(want[:11]) + "\n")
    _infer(model_dir, part)
    assert _lines(part) == want
    out = capsys.readouterr().out
    assert f"infer: wrote {N_EXAMPLES - 8} records to {part} after the 8 already there" in out
    # Complete: refused, untouched.
    before = full.read_bytes()
    with pytest.raises(FileExistsError, match="is complete"):
        _infer(model_dir, full)
    assert full.read_bytes() == before


def test_foreign_output_is_refused_untouched(model_dir, tmp_path):
    out = tmp_path / "other.jsonl"
    rec = {"task": "synthetic_reverse", "inputs": "not this one", "targets": "", "prediction": ""}
    out.write_text(json.dumps(rec) + "\n")
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"other.jsonl:1 does not match example 1"):
        _infer(model_dir, out)
    assert out.read_bytes() == before
    out.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"other.jsonl:1 is not a JSON record"):
        _infer(model_dir, out)


def test_score_mode_and_beam_predictions(model_dir, tmp_path):
    scores = tmp_path / "scores.jsonl"
    _infer(model_dir, scores, mode="score")
    values = [json.loads(line)["score"] for line in _lines(scores)]
    assert len(values) == N_EXAMPLES and all(np.isfinite(values)) and max(values) < 0
    beams = tmp_path / "beam.jsonl"
    _infer(model_dir, beams, dataclasses.replace(_model(), decoding_method="beam", beam_size=2))
    assert len(_lines(beams)) == N_EXAMPLES
    with pytest.raises(ValueError, match="infer mode"):
        _infer(model_dir, tmp_path / "x.jsonl", mode="generate")
