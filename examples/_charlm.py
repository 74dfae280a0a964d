"""A tiny byte-level transformer language model, sharded over a 2-D device mesh.

Support code for ``elastic_resume.py``: the model, the training data, the
sharding rules and a jitted train step. Nothing in here knows about
checkpointing.

The training text is the Python documentation that ships with the standard
library (``pydoc_data.topics``), encoded as UTF-8 bytes, so the vocabulary is
the 256 byte values and no download is needed.
"""

import dataclasses
from collections.abc import Callable
from pydoc_data.topics import topics
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"
VOCAB_SIZE = 256  # one token per byte value


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training hyper-parameters.

    Attributes:
        d_model: Width of the residual stream.
        num_heads: Attention heads per layer.
        num_layers: Transformer blocks.
        seq_len: Tokens per training sequence.
        batch_size: Sequences per global batch (split over the data axis).
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW decoupled weight decay.
        init_seed: Seed of the parameter initialisation.
        data_seed: Seed from which every step's batch is derived.
    """

    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    seq_len: int = 64
    batch_size: int = 16
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    init_seed: int = 0
    data_seed: int = 1234


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    d_model: int
    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the block.

        Args:
            x: Activations of shape ``(batch, seq, d_model)``.

        Returns:
            Activations of the same shape.
        """
        batch, seq, _ = x.shape
        head_dim = self.d_model // self.num_heads
        qkv = nn.Dense(3 * self.d_model, name="qkv")(nn.LayerNorm(name="ln_attn")(x))
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * self.num_heads, head_dim), 3, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, self.d_model)
        x = x + nn.Dense(self.d_model, name="attn_out")(attended)
        hidden = nn.gelu(nn.Dense(4 * self.d_model, name="mlp_in")(nn.LayerNorm(name="ln_mlp")(x)))
        return x + nn.Dense(self.d_model, name="mlp_out")(hidden)


class CharLM(nn.Module):
    """Decoder-only transformer over byte tokens."""

    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Computes next-token logits.

        Args:
            tokens: Integer byte tokens of shape ``(batch, seq)``.

        Returns:
            Logits of shape ``(batch, seq, VOCAB_SIZE)``.
        """
        cfg = self.config
        x = nn.Embed(VOCAB_SIZE, cfg.d_model, name="tok_embed")(tokens)
        x = x + nn.Embed(cfg.seq_len, cfg.d_model, name="pos_embed")(jnp.arange(tokens.shape[1]))
        for i in range(cfg.num_layers):
            x = Block(cfg.d_model, cfg.num_heads, name=f"block_{i}")(x)
        return nn.Dense(VOCAB_SIZE, name="lm_head")(nn.LayerNorm(name="ln_final")(x))


def load_corpus() -> np.ndarray:
    """Returns the training text as a flat array of UTF-8 byte tokens.

    Returns:
        A 1-D ``uint8`` array of about 466k tokens.
    """
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def batch_for_step(corpus: np.ndarray, step: int, config: Config) -> np.ndarray:
    """Returns the batch for a training step, a pure function of the step number.

    A resumed run therefore sees exactly the batches the uninterrupted run saw.

    Args:
        corpus: Byte tokens from :func:`load_corpus`.
        step: 1-based training step.
        config: Supplies ``batch_size``, ``seq_len`` and ``data_seed``.

    Returns:
        An ``int32`` array of shape ``(batch_size, seq_len + 1)``: inputs are
        ``[:, :-1]`` and next-token targets are ``[:, 1:]``.
    """
    rng = np.random.default_rng([config.data_seed, step])
    starts = rng.integers(0, len(corpus) - config.seq_len - 1, size=config.batch_size)
    return np.stack([corpus[s : s + config.seq_len + 1] for s in starts]).astype(np.int32)


def make_mesh(data: int, model: int) -> jax.sharding.Mesh:
    """Builds a ``data x model`` device mesh over the devices of every process.

    Devices are laid out process by process, so with several processes each
    one owns whole rows of the mesh: the ``data`` axis splits across processes
    and the ``model`` axis stays inside one. Only the gradient all-reduce over
    ``data`` then crosses process boundaries.

    The axes are ``Auto`` so that XLA inserts the collectives implied by the
    parameter shardings; ``jax.make_mesh`` would default to ``Explicit`` axes.

    Args:
        data: Size of the data-parallel axis.
        model: Size of the model-parallel axis.

    Returns:
        The mesh.

    Raises:
        ValueError: If ``data * model`` is not the number of devices.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if data * model != len(devices):
        raise ValueError(f"mesh {data} x {model} needs {data * model} devices, not {len(devices)}")
    return jax.sharding.Mesh(
        np.array(devices).reshape(data, model),
        (DATA_AXIS, MODEL_AXIS),
        axis_types=(AxisType.Auto,) * 2,
    )


def partition_spec_for(shape: tuple[int, ...], model_size: int) -> PartitionSpec:
    """Chooses how to shard one parameter or optimizer-state array.

    Matrices (and higher-rank arrays) split their largest dimension (the last
    one on a tie) over the ``model`` axis when it divides evenly; vectors and
    scalars are replicated.

    Args:
        shape: Shape of the array.
        model_size: Number of devices along the ``model`` mesh axis.

    Returns:
        The partition spec.
    """
    if len(shape) < 2:
        return PartitionSpec()
    dim = max(range(len(shape)), key=lambda d: (shape[d], d))
    if shape[dim] % model_size:
        return PartitionSpec()
    spec = [None] * len(shape)
    spec[dim] = MODEL_AXIS
    return PartitionSpec(*spec)


def with_data_axis(spec: PartitionSpec, shape: tuple[int, ...], data_size: int) -> PartitionSpec:
    """Also splits an optimizer-state array over ``data`` (ZeRO stage 1).

    The first dimension not already split, and divisible by ``data_size``, goes
    over ``data``; if there is none the spec is unchanged. Parameters stay
    replicated over ``data`` (every data-parallel replica needs them whole), but
    the AdamW moments are only read by the update, so each data replica can keep
    a slice: with ``data`` spanning processes, each process then holds, and
    checkpoints, its own part of them.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim, size in enumerate(shape):
        if entries[dim] is None and size % data_size == 0:
            entries[dim] = DATA_AXIS
            return PartitionSpec(*entries)
    return spec


def state_shardings(abstract_state: Any, mesh: jax.sharding.Mesh) -> Any:
    """Returns a pytree of ``NamedSharding`` matching ``abstract_state``.

    Parameters are split over ``model`` (:func:`partition_spec_for`); the
    optimizer state is in addition split over ``data`` (:func:`with_data_axis`).

    Args:
        abstract_state: Pytree whose leaves have a ``.shape`` (arrays or
            ``jax.ShapeDtypeStruct``).
        mesh: Mesh with ``data`` and ``model`` axes.

    Returns:
        A pytree of the same structure holding one sharding per leaf.
    """
    model_size, data_size = mesh.shape[MODEL_AXIS], mesh.shape[DATA_AXIS]

    def sharding(path, leaf) -> NamedSharding:
        spec = partition_spec_for(leaf.shape, model_size)
        if any(getattr(k, "name", None) == "opt_state" for k in path) and len(leaf.shape) >= 1:
            spec = with_data_axis(spec, leaf.shape, data_size)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Returns the sharding of a token batch: rows split over ``data``.

    Args:
        mesh: Mesh with a ``data`` axis.

    Returns:
        The sharding.
    """
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS, None))


def device_batch(tokens: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """Places a global batch on the mesh, rows split over ``data``.

    Every process passes the same global batch and contributes only the rows
    its own devices hold, so this also works when the mesh spans several
    processes (``jax.device_put`` of a host array cannot target devices of
    other processes).

    Args:
        tokens: The global batch from :func:`batch_for_step`.
        mesh: Mesh with a ``data`` axis.

    Returns:
        A ``jax.Array`` with the sharding of :func:`batch_sharding`.
    """
    return jax.make_array_from_callback(
        tokens.shape, batch_sharding(mesh), lambda index: tokens[index]
    )


def make_init_fn(config: Config) -> Callable[[], train_state.TrainState]:
    """Returns a zero-argument function that builds the initial TrainState.

    Pass it to ``jax.eval_shape`` for an abstract state, or to ``jax.jit``
    with ``out_shardings`` for a concrete sharded one.

    Args:
        config: Model and optimizer settings.

    Returns:
        The init function.
    """
    model = CharLM(config)
    optimizer = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)

    def init() -> train_state.TrainState:
        dummy_tokens = jnp.zeros((1, config.seq_len), jnp.int32)
        params = model.init(jax.random.key(config.init_seed), dummy_tokens)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    return init


def init_state(config: Config, mesh: jax.sharding.Mesh) -> train_state.TrainState:
    """Initialises a TrainState directly in its sharded layout.

    Args:
        config: Model and optimizer settings.
        mesh: Target mesh.

    Returns:
        The TrainState, every leaf a sharded ``jax.Array``.
    """
    init = make_init_fn(config)
    shardings = state_shardings(jax.eval_shape(init), mesh)
    return jax.jit(init, out_shardings=shardings)()


def make_train_step(
    state_sharding: Any, mesh: jax.sharding.Mesh
) -> Callable[[train_state.TrainState, jax.Array], tuple[train_state.TrainState, jax.Array]]:
    """Returns a jitted AdamW step that keeps the state in its sharded layout.

    Args:
        state_sharding: Pytree of shardings from :func:`state_shardings`.
        mesh: The mesh the state lives on.

    Returns:
        ``step(state, batch) -> (new_state, loss)``; ``state`` is donated.
    """

    def step(state: train_state.TrainState, batch: jax.Array):
        inputs, targets = batch[:, :-1], batch[:, 1:]

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding(mesh)),
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )
