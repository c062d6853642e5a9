"""`t5lite convert`: Hugging Face safetensors checkpoints <-> t5lite TensorStore checkpoints.

Import writes `OUT/checkpoint_0` (a params-only t5lite checkpoint whose extra state records the
network config and the special token ids), `OUT/model.gin` (the network config, the model's
pad / EOS / decoder-start ids and attention type as gin bindings, and the vocabulary) and copies
the tokenizer files. Fine-tune from it with `--gin.CheckpointConfig.init_checkpoint=
'OUT/checkpoint_0'` and `--gin_file=OUT/model.gin`. Export reads the config and ids back from the
checkpoint and writes `config.json` + `model.safetensors`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from t5lite.checkpoint import CheckpointManager, restore_checkpoint
from t5lite.hf import tokens
from t5lite.hf import weights as hf_convert
from t5lite.model import lora, network
from t5lite.model.config import MoeFields, config_from_record, config_record

_MODEL_OF = {"T5Config": "EncoderDecoderModel", "DecoderOnlyConfig": "DecoderOnlyModel"}


def model_gin(
    config: network.T5Config | network.DecoderOnlyConfig,
    ids: tokens.ModelIds = tokens.ModelIds(),  # noqa: B008  (frozen)
    extra_lines: list[str] | None = None,
) -> str:
    """Gin bindings that rebuild the model (to combine with run and partitioning presets)."""
    kind, model = type(config).__name__, _MODEL_OF[type(config).__name__]
    lines = [
        "# Written by `t5lite convert`: the imported model's network config.",
        "import t5lite.cli.registry",
        "",
        f"MODEL = @{model}()",
        f"{model}.network_config = @network.{kind}()",
    ]
    # The model's own fields first, the mixture-of-experts ones (inherited, so first in
    # `asdict`) after them: a dense model's file should not open with thirteen moe_* lines.
    moe = {f.name for f in dataclasses.fields(MoeFields)}
    for k, v in sorted(dataclasses.asdict(config).items(), key=lambda kv: kv[0] in moe):
        lines.append(f"network.{kind}.{k} = {v!r}")
    lines += ["", "# Special token ids from the Hugging Face config (decoding stops at eos_id)."]
    lines += [f"{model}.{k} = {v!r}" for k, v in dataclasses.asdict(ids).items()]
    if model == "DecoderOnlyModel":
        # A causal LM was trained with causal attention over its prompts too.
        lines += [
            "",
            "# A causal LM: prompts attend causally, as in pre-training.",
            "DecoderOnlyModel.inputs_bidirectional_attention = False",
        ]
    if extra_lines:
        lines += ["", *extra_lines]
    return "\n".join(lines) + "\n"


def hf_to_t5lite(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, scan_layers: bool = False
) -> Path:
    """Imports a Hugging Face checkpoint directory; returns the t5lite checkpoint path."""
    out = Path(out_dir)
    gin_path = out / "model.gin"
    if gin_path.exists():
        raise FileExistsError(f"convert: {gin_path} exists; refusing to overwrite it")
    config, params = hf_convert.import_hf(hf_dir, scan_layers=scan_layers)
    encoder_decoder = isinstance(config, network.T5Config)
    hf_ids = tokens.read_hf_ids(hf_dir)
    ids, notes = tokens.model_ids(hf_ids, encoder_decoder)
    mgr = CheckpointManager(out, async_save=False)
    extra = {
        "network_config": config_record(config),
        "token_ids": dataclasses.asdict(ids),
        "hf_token_ids": hf_ids,
        "source": str(hf_dir),
    }
    mgr.save(0, {"params": params}, extra=extra)
    mgr.close()
    copied = tokens.copy_tokenizer_files(hf_dir, out)
    vocab = tokens.vocabulary_gin(out, copied, encoder_decoder)
    gin_path.write_text(model_gin(config, ids, [*(f"# NOTE: {n}." for n in notes), *vocab]))
    return mgr.step_dir(0)


def t5lite_to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Exports the parameters of a t5lite checkpoint (one written by import, or by training
    from an imported one) as a Hugging Face directory that must not exist yet."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"convert: {out} is not empty; refusing to overwrite it")
    state, extra = restore_checkpoint(checkpoint, None)
    if not extra or "network_config" not in extra:
        raise ValueError(
            f"{checkpoint}: no network config in its extra state (export needs a checkpoint "
            "written by `t5lite convert` or by training with `CheckpointConfig.init_checkpoint`)"
        )
    # Checkpoints from before the ids were recorded decode with t5lite's defaults.
    ids = tokens.ModelIds(**extra.get("token_ids", {}))
    params = state["params"]
    if "lora" in extra:  # a LoRA fine-tune: its adapters are folded into the kernels
        params = lora.merge(lora.LoRA(**extra["lora"]), params)
    config = config_from_record(extra["network_config"])
    hf_convert.export_hf(config, params, out, ids, extra.get("hf_token_ids"))
    return out
