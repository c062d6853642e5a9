"""A toy transformer block (embedding, attention-like block, MLP block) with logical axes."""

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, EMBED, MLP, HEADS, KV = 64, 16, 32, 8, 4
init = nn.initializers.normal(0.2)


def param(mod: nn.Module, name: str, shape, axes):
    return mod.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x_BLD):
        wi = param(self, "wi", (EMBED, MLP), ("embed", "mlp"))
        wo = param(self, "wo", (MLP, EMBED), ("mlp", "embed"))
        h_BLF = nn.with_logical_constraint(jax.nn.gelu(x_BLD @ wi), ("batch", "length", "mlp"))
        return nn.with_logical_constraint(h_BLF @ wo, ("batch", "length", "embed"))


class AttentionBlock(nn.Module):
    @nn.compact
    def __call__(self, x_BLD):
        q = param(self, "query", (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        k = param(self, "key", (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        v = param(self, "value", (EMBED, HEADS, KV), ("embed", "heads", "kv"))
        o = param(self, "out", (HEADS, KV, EMBED), ("heads", "kv", "embed"))
        q_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, q)
        k_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, k)
        v_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, v)
        q_BLHK = nn.with_logical_constraint(q_BLHK, ("batch", "length", "heads", "kv"))
        w_BHLL = jax.nn.softmax(jnp.einsum("blhk,bmhk->bhlm", q_BLHK, k_BLHK), axis=-1)
        y_BLHK = jnp.einsum("bhlm,bmhk->blhk", w_BHLL, v_BLHK)
        return nn.with_logical_constraint(
            jnp.einsum("blhk,hkd->bld", y_BLHK, o), ("batch", "length", "embed")
        )


class ToyModel(nn.Module):
    @nn.compact
    def __call__(self, tokens_BL):
        emb = param(self, "embedding", (VOCAB, EMBED), ("vocab", "embed"))
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (EMBED,)
        )
        x_BLD = nn.with_logical_constraint(emb[tokens_BL], ("batch", "length", "embed"))
        x_BLD = x_BLD + AttentionBlock(name="attn")(x_BLD)
        x_BLD = (x_BLD + MlpBlock(name="mlp")(x_BLD)) * scale
        logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, emb)
        return nn.with_logical_constraint(logits_BLV, ("batch", "length", "vocab"))


def loss_fn(params, tokens_BL):
    logits = ToyModel().apply({"params": params}, tokens_BL)
    logp = jax.nn.log_softmax(logits)
    targets = jnp.roll(tokens_BL, -1, axis=1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
