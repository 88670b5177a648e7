"""The reference loop's model: a transformers Llama and a static, slot-indexed KV cache.

:func:`tiny_llama` builds a small ``LlamaForCausalLM`` with random weights (nothing is
downloaded); :func:`load_model` reads a local checkpoint directory. :class:`SlotKVCache` is a
transformers ``Cache`` whose layers hold one row per sequence slot, allocated once at full size,
so that a decode step over any set of slots has static shapes and can be captured in a CUDA
graph. transformers' own ``StaticCache`` keeps one write offset for the whole batch; here each
row of a step writes at its own positions, which a batch of sequences of different lengths needs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

__all__ = ["tiny_llama", "load_model", "SlotKVCache"]


def tiny_llama(vocab_size: int, seed: int = 0, *, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int | None = None, intermediate: int | None = None,
               max_positions: int = 4096, eos_token_id: int | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
               ) -> "PreTrainedModel":
    """A small ``LlamaForCausalLM`` with random weights drawn from ``seed`` (no download).

    The global torch RNG is left as it was. Embeddings are tied to the output head, so the
    vocabulary costs ``vocab_size * hidden`` parameters once.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if vocab_size < 1 or hidden % heads:
        raise ConfigError(f"tiny_llama: vocab_size={vocab_size} must be >= 1 and hidden={hidden} "
                          f"divisible by heads={heads}")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_token_id,
        pad_token_id=None)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # (transformers types PreTrainedModel.to through a decorator mypy misreads)
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def load_model(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> "PreTrainedModel":
    """A causal LM from a local checkpoint directory (``local_files_only``: no hub access)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise ConfigError(f"load_model: {os.fspath(path)!r} is not a directory")
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), local_files_only=True,
                                                 attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]  # (as in tiny_llama)


class _WriteTarget:
    """Where this forward's new keys and values go: ``slot_ids [B]`` and ``positions [B, T]``.

    Set by the runner before each forward (references to static tensors, so a captured graph
    reads whatever values were copied into them before replay).
    """

    __slots__ = ("slot_ids", "positions")

    def __init__(self) -> None:
        self.slot_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values for every slot: ``[num_slots, max_seq_len, kv_heads, hd]``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, target: _WriteTarget, shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.target = target
        # typed references: the base class declares keys/values Optional
        self.slot_keys = self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_values = self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.max_cache_len = shape[1]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated at construction: a captured graph must see fixed addresses

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, kv_heads, T, hd]; indices [B, 1] x [B, T] address [B, T, kv_heads, hd]
        slots, pos = self.target.slot_ids, self.target.positions
        if slots is None or pos is None:
            raise RuntimeError("SlotKVCache: set cache.target.slot_ids and .positions before "
                               "the forward")
        keys, values = self.slot_keys, self.slot_values
        keys.index_put_((slots[:, None], pos), key_states.transpose(1, 2))
        values.index_put_((slots[:, None], pos), value_states.transpose(1, 2))
        # this step's slots, whole rows: [B, kv_heads, max_seq_len, hd]
        return keys[slots].transpose(1, 2), values[slots].transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        return 0  # lengths are per slot: the runner tracks them and always passes position_ids

    def get_max_length(self) -> int:
        return self.max_cache_len


class SlotKVCache(Cache):
    """A ``Cache`` of ``num_slots`` sequence rows of ``max_seq_len`` positions per layer.

    Every layer's keys and values are allocated here at full size and never move. Before a
    forward, point ``cache.target.slot_ids`` / ``cache.target.positions`` at this step's
    ``[B]`` slots and ``[B, T]`` positions: row ``b`` writes its ``T`` keys at ``positions[b]``
    of slot ``slot_ids[b]`` and attends over that slot's whole row, the attention mask deciding
    which positions count. Positions past a sequence's true length hold stale values (rejected
    drafts, a previous occupant of the slot); they are masked, and overwritten when reached.
    """

    def __init__(self, config, num_slots: int, max_seq_len: int, *,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        text = config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.target = _WriteTarget()
        shape = (num_slots, max_seq_len, kv_heads, head_dim)
        device = torch.device(device)
        self.slot_layers = [_SlotLayer(self.target, shape, dtype, device)
                            for _ in range(text.num_hidden_layers)]
        super().__init__(layers=list(self.slot_layers))
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-slot key and value caches of every layer."""
        return sum(layer.slot_keys.nbytes + layer.slot_values.nbytes
                   for layer in self.slot_layers)
