"""docs/huggingface.md's fine-tuning walkthrough runs as written: HF T5 and Llama in,
fine-tuned, HF out."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from readme_blocks import block
from readme_blocks import run as run_block

pytestmark = pytest.mark.slow  # two imports, two fine-tunes, two evals, two exports
pytest.importorskip("transformers", reason="needs the [hf] extra (the block writes HF models)")
safetensors = pytest.importorskip("safetensors.numpy", reason="needs the [hf] extra")

ROOT = Path("/tmp/t5lite_walkthrough")


def _losses(run: str) -> list[float]:
    lines = (ROOT / run / "metrics.jsonl").read_text().splitlines()
    return [m["loss"] for m in map(json.loads, lines) if m.get("split") == "train" and "loss" in m]


def test_walkthrough_imports_finetunes_evaluates_and_exports():
    shutil.rmtree(ROOT, ignore_errors=True)  # as on a fresh machine
    out = run_block(block("docs/huggingface.md", "walkthrough"), timeout=1800)
    assert "transformers loads both" in out.stdout
    for run in ("t5_ft", "llama_lora"):
        assert (ROOT / run / "checkpoint_30" / "COMMIT").is_file()
        evals = [
            json.loads(line)
            for p in (ROOT / run / "eval").glob("*/*.jsonl")
            for line in p.read_text().splitlines()
        ]  # eval/<task>/<split>.jsonl
        assert evals and {r["step"] for r in evals} == {30}
        losses = _losses(run)
        assert losses and losses[-1] < losses[0], (run, losses)
    # The exports keep the imported ids.
    t5 = json.loads((ROOT / "hf_t5_ft" / "config.json").read_text())
    assert (t5["pad_token_id"], t5["eos_token_id"], t5["decoder_start_token_id"]) == (0, 1, 0)
    llama = json.loads((ROOT / "hf_llama_ft" / "config.json").read_text())
    assert (llama["pad_token_id"], llama["eos_token_id"], llama["bos_token_id"]) == (0, 1, 2)
    # LoRA trained only the adapted projections (query and value by default), merged on export;
    # every other weight is the imported one.
    before = safetensors.load_file(str(ROOT / "hf_llama" / "model.safetensors"))
    after = safetensors.load_file(str(ROOT / "hf_llama_ft" / "model.safetensors"))
    changed = sorted(k for k in before if not np.allclose(before[k], after[k], atol=0, rtol=0))
    assert changed and all(re.search(r"self_attn\.(q|v)_proj\.weight$", k) for k in changed)
    assert len(changed) == 4  # q and v of 2 layers
