"""A t5lite model as an lm-evaluation-harness `LM`: scoring and generation on its mesh.

Requests are tokenized as lm-eval's own `hf` model does (`TemplateLM`: a causal model scores a
continuation given its context in one sequence; an encoder-decoder reads the context in the
encoder and scores the continuation as decoder targets), batched by length, and run through the
model's teacher-forced logits (`BaseModel._logits`, the path of `score_batch`) and its KV-cached
decoder (`Trainer.predict_fn`) on the partitioner's mesh. Needs the `[eval]` extra.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences

from t5lite.model import losses
from t5lite.model.models import BaseModel
from t5lite.partitioning import Partitioner
from t5lite.programs.harness_gen import Generation, generation
from t5lite.programs.harness_tokens import Tokens
from t5lite.trainer import Trainer

_MIN_LENGTH = 16  # rows are padded to a power of two at least this long (few compilations)


@dataclasses.dataclass(frozen=True)
class _Row:
    """One scoring row: the tokens fed, the tokens predicted, which of them count."""

    inputs: list[int]  # decoder-only: the whole row; encoder-decoder: the encoder's
    targets: list[int]  # the tokens predicted at each decoder position
    num_scored: int  # the last this many targets are the continuation
    prompt: int = 0  # decoder-only: positions of the context (prefix-LM attention)


class T5LiteLM(TemplateLM):
    """lm-eval's `loglikelihood`, `loglikelihood_rolling` and `generate_until` for a t5lite
    model and its parameters (any mesh, as its partitioner lays them out).

    Args:
      model: the model (its family decides causal or seq2seq scoring).
      params: its parameters, laid out by `partitioner` as a `Trainer` lays them out.
      tokens: the model's vocabulary (`harness_tokens.find_tokens`).
      partitioner: the mesh and rules.
      batch_size: rows per compiled batch (a multiple of the data-parallel size).
      max_length: tokens per row at most; longer contexts lose their start (as lm-eval's `hf`).
      max_gen_toks: tokens generated when a task does not say.
      seed: the seed of sampled generation (greedy decoding does not use it).
    """

    def __init__(
        self,
        model: BaseModel,
        params: Any,
        tokens: Tokens,
        *,
        partitioner: Partitioner,
        batch_size: int = 8,
        max_length: int = 512,
        max_gen_toks: int = 256,
        seed: int = 0,
    ):
        super().__init__()
        self.model, self.params, self.tokens = model, params, tokens
        self.partitioner, self.batch_size, self.seed = partitioner, batch_size, seed
        self.max_length, self.max_gen_toks = max_length, max_gen_toks
        self.backend = "seq2seq" if model.feature_converter_name == "enc_dec" else "causal"
        self._trainers: dict[Any, Trainer] = {}
        self._scorers: dict[Any, Callable] = {}
        self._decoders: dict[Any, BaseModel] = {}

    # --- tokens ----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.bos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        return self.tokens.encode(string, add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tokens.decode(tokens)

    # --- compiled functions, one per row shape -----------------------------------------------

    def _trainer(self, model: BaseModel, lengths: dict[str, int]) -> Trainer:
        key = (id(model), tuple(sorted(lengths.items())))
        if key not in self._trainers:
            self._trainers[key] = Trainer(
                model, self.partitioner, batch_size=self.batch_size, lengths=lengths, seed=self.seed
            )
        return self._trainers[key]

    def _scorer(self, lengths: dict[str, int]) -> tuple[Trainer, Callable]:
        trainer = self._trainer(self.model, lengths)
        key = tuple(sorted(lengths.items()))
        if key not in self._scorers:
            self._scorers[key] = self.partitioner.partition(
                functools.partial(_score_rows, self.model),
                in_shardings=(trainer.state_shardings.params, trainer.batch_shardings),
                out_shardings=None,
            )
        return trainer, self._scorers[key]

    # --- scoring ---------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs
    ) -> list[tuple[float, bool]]:
        rows = [self._row(context, continuation) for _, context, continuation in requests]
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for chunk in _chunks(rows, self.batch_size, key=lambda r: len(r.inputs)):
            batch, lengths = self._score_batch([rows[i] for i in chunk])
            trainer, score = self._scorer(lengths)
            result = score(self.params, trainer.global_batch_from_full(batch))
            logp, greedy = (np.asarray(x) for x in jax.device_get(result))
            for j, i in enumerate(chunk):
                out[i] = (float(logp[j]), bool(greedy[j]))
        return out

    def _row(self, context: list[int], continuation: list[int]) -> _Row:
        """lm-eval `hf`'s truncation: a causal row keeps its last `max_length` + 1 tokens."""
        if self.backend == "seq2seq":
            cont = continuation[-self.max_length :]
            return _Row(context[-self.max_length :], cont, len(cont))
        whole = (context + continuation)[-(self.max_length + 1) :]
        num_scored = min(len(continuation), len(whole) - 1)
        # The context fills input positions [0, len(whole) - num_scored): prefix-LM's prompt.
        return _Row(whole[:-1], whole[1:], num_scored, prompt=len(whole) - num_scored)

    def _score_batch(self, rows: list[_Row]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Right-padded features (`decoder_target_tokens` holds the true targets)."""
        n = self.batch_size
        if self.backend == "seq2seq":
            li = _bucket(max(len(r.inputs) for r in rows), self.max_length)
            lt = _bucket(max(len(r.targets) for r in rows), self.max_length)
            enc = _pad([r.inputs for r in rows], n, li)
            targets = _pad([r.targets for r in rows], n, lt)
            dec_in = _pad(
                [[self.model.decoder_start_token_id, *r.targets[:-1]] for r in rows], n, lt
            )
            weights = _pad([[1] * len(r.targets) for r in rows], n, lt)
            batch = {
                "encoder_input_tokens": enc,
                "encoder_segment_ids": (_pad([[1] * len(r.inputs) for r in rows], n, li)),
                "encoder_positions": _positions(n, li),
                "decoder_input_tokens": dec_in,
                "decoder_target_tokens": targets,
                "decoder_loss_weights": weights,
                "decoder_segment_ids": weights.copy(),
                "decoder_positions": _positions(n, lt),
            }
            return batch, {"inputs": li, "targets": lt}
        length = _bucket(max(len(r.inputs) for r in rows), self.max_length)
        valid = [[1] * len(r.inputs) for r in rows]
        batch = {
            "decoder_input_tokens": _pad([r.inputs for r in rows], n, length),
            "decoder_target_tokens": _pad([r.targets for r in rows], n, length),
            "decoder_loss_weights": _pad(
                [[0] * (len(r.targets) - r.num_scored) + [1] * r.num_scored for r in rows],
                n,
                length,
            ),
            "decoder_segment_ids": _pad(valid, n, length),
            "decoder_positions": _positions(n, length),
        }
        if self.model.feature_converter_name == "prefix_lm":
            batch["decoder_causal_attention"] = _pad([[1] * r.prompt for r in rows], n, length)
        return batch, {"targets": length}

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of `max_length` tokens, the first
        conditioned on `prefix_token_id` (as lm-eval's `hf`)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append((None, *lm_utils.make_disjoint_window(w)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations from the model's KV-cached decoder, greedy or sampled as each task's
        `generation_kwargs` say (`harness_gen.generation`), cut at its stop strings; a
        decoder-only prompt starts with the model's start token (BOS).

        Sampling is deterministic for a given `seed`: every call starts from it, and its k-th
        batch (requests grouped by `generation_kwargs` in order of first appearance, longest
        prompts first) samples with `fold_in(PRNGKey(seed), k)`.
        """
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        # Every group's settings are checked before anything compiles.
        settings = [
            generation(requests[idx[0]].args[1], self.max_gen_toks) for idx in groups.values()
        ]
        eos = self.tok_decode([self.eot_token_id])
        out: list[str] = [""] * len(requests)
        batch_index = 0
        for idx, gen in zip(groups.values(), settings):
            until = handle_stop_sequences(list(gen.until), eos=eos)
            room = self.max_length - (gen.max_gen_toks if self.backend == "causal" else 0)
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in idx]
            for chunk in _chunks(prompts, self.batch_size, key=len):
                texts = self._generate([prompts[j] for j in chunk], gen, batch_index)
                batch_index += 1
                for j, text in zip(chunk, texts):
                    for term in until:
                        text = text.split(term)[0] if term else text
                    out[idx[j]] = text
                    req = requests[idx[j]]
                    self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _decoder(self, gen: Generation) -> BaseModel:
        """The model as it decodes `gen` (kept, so the trainer cache's id() keys stay valid)."""
        key = (gen.temperature, gen.top_k, gen.top_p)
        if key not in self._decoders:
            fields: dict[str, Any] = {"decoding_method": "greedy"}
            if not gen.greedy:
                # transformers' top-k keeps the whole vocabulary when k exceeds it.
                top_k = gen.top_k if gen.top_k < self.model.network_config.vocab_size else 0
                fields = {
                    "decoding_method": "sample",
                    "temperature": gen.temperature,
                    "top_k": top_k,
                    "top_p": gen.top_p,
                    "num_decodes": 1,
                    "min_log_prob": None,
                }
            if self.backend == "causal":
                # The prompt marked by `decoder_causal_attention`; a causal LM attends causally.
                causal_lm = self.model.feature_converter_name == "lm"
                fields["feature_converter"] = "prefix_lm"
                fields["inputs_bidirectional_attention"] = (
                    False if causal_lm else self.model.inputs_bidirectional_attention
                )
            self._decoders[key] = dataclasses.replace(self.model, **fields)
        return self._decoders[key]

    def _generate(self, prompts: list[list[int]], gen: Generation, batch_index: int) -> list[str]:
        n, max_gen = self.batch_size, gen.max_gen_toks
        if self.backend == "seq2seq":
            li = _bucket(max(len(p) for p in prompts), self.max_length)
            lt = _bucket(max_gen, None)
            # Decoding reads the encoder input only; the other features are shaped zeros.
            batch = {
                "encoder_input_tokens": _pad(prompts, n, li),
                "decoder_input_tokens": np.zeros((n, lt), np.int32),
                "decoder_target_tokens": np.zeros((n, lt), np.int32),
            }
            lengths = {"inputs": li, "targets": lt}
        else:
            start = self.model.decoder_start_token_id
            prompts = [p if p[:1] == [start] else [start, *p] for p in prompts]
            length = _bucket(max(len(p) for p in prompts) + max_gen, None)
            batch = {
                "decoder_input_tokens": _pad(prompts, n, length),
                "decoder_target_tokens": _pad(prompts, n, length),  # unread by decoding
                "decoder_causal_attention": _pad([[1] * len(p) for p in prompts], n, length),
            }
            lengths = {"targets": length}
        trainer = self._trainer(self._decoder(gen), lengths)
        ids = trainer.predict_fn(self.params, max_gen)(batch, rng_index=batch_index)
        return [self.tok_decode(r) for r in ids[: len(prompts)]]


def _score_rows(model: BaseModel, params: Any, batch: dict[str, jax.Array]):
    """Per row: the summed log-likelihood of the weighted targets [B], and whether each of them
    is the argmax of its logits [B] (lm-eval's `is_greedy`)."""
    targets_BL = batch["decoder_target_tokens"]
    weights_BL = batch["decoder_loss_weights"]
    # NOTE: the network masks keys whose `decoder_target_tokens` is 0 as padding; a real target
    # may be id 0 (Llama's <unk>), so the network sees the row's validity there instead.
    features = {**batch, "decoder_target_tokens": batch["decoder_segment_ids"]}
    logits_BLV = model._logits(params, features, None).astype(jnp.float32)
    token_loss_BL, _ = losses.cross_entropy_with_logits(logits_BLV, targets_BL, 0.0)
    logp_B = -jnp.sum(token_loss_BL * weights_BL, axis=-1)
    hit_BL = jnp.argmax(logits_BLV, axis=-1) == targets_BL
    greedy_B = jnp.all(hit_BL | (weights_BL == 0), axis=-1)
    return logp_B, greedy_B


def _bucket(n: int, cap: int | None) -> int:
    """The row length for `n` tokens: a power of two (>= 16), at least `n`."""
    length = max(_MIN_LENGTH, 1 << max(n - 1, 0).bit_length())
    return max(n, min(length, cap)) if cap else length


def _pad(rows: list[list[int]], num_rows: int, length: int) -> np.ndarray:
    out = np.zeros((num_rows, length), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _positions(num_rows: int, length: int) -> np.ndarray:
    return np.broadcast_to(np.arange(length, dtype=np.int32), (num_rows, length)).copy()


def _chunks(items: list, size: int, key: Callable) -> list[list[int]]:
    """Indices of `items`, longest first, in chunks of `size` (rows of like length together)."""
    order = sorted(range(len(items)), key=lambda i: -key(items[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]
