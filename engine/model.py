"""Moved to `engine/models/` (one file per family over shared layers); this re-export keeps the
old import path working for branches written before the move. New code imports engine.models.*."""

from engine.models.attention import Attention  # noqa: F401
from engine.models.causal_lm import CausalLM  # noqa: F401
from engine.models.decoder import DecoderLayer  # noqa: F401
from engine.models.embedding import VocabParallelEmbedding  # noqa: F401
from engine.models.linear import BF16_UPCAST_ROWS, PACK_BATCH_HINT, Linear, onednn_linear_available  # noqa: F401
from engine.models.llama import LlamaForCausalLM  # noqa: F401
from engine.models.mlp import MLP  # noqa: F401
from engine.models.norm import RMSNorm  # noqa: F401
