from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output", "structured", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    structured: StructuredSpec
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured: _Optional[_Union[StructuredSpec, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredSpec(_message.Message):
    __slots__ = ("kind", "text", "any_whitespace", "after_token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    any_whitespace: bool
    after_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., any_whitespace: _Optional[bool] = ..., after_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "block_size", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "max_model_len", "vocab_size", "layer_windows", "kv_transfer_window", "draft_kv", "kv_group_windows", "kv_page_slots")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    block_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    kv_transfer_window: int
    draft_kv: DraftKvInfo
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    kv_page_slots: int
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., layer_windows: _Optional[_Iterable[int]] = ..., kv_transfer_window: _Optional[int] = ..., draft_kv: _Optional[_Union[DraftKvInfo, _Mapping]] = ..., kv_group_windows: _Optional[_Iterable[int]] = ..., kv_page_slots: _Optional[int] = ...) -> None: ...

class DraftKvInfo(_message.Message):
    __slots__ = ("model_fingerprint", "kv_dtype", "num_layers", "num_kv_heads", "head_dim")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("token_logprobs", "token_ranks", "num_top", "top_token_ids", "top_logprobs")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., token_ranks: _Optional[_Iterable[int]] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("pod_id", "role", "num_waiting", "num_running", "prefill_queue_tokens", "num_free_blocks", "num_total_blocks", "step_seconds_ewma", "prefill_tokens_per_second", "step_samples", "timestamp", "draining", "block_size", "max_num_seqs", "num_held_kv", "max_num_batched_tokens", "lora_adapters", "max_loras")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_EWMA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_KV_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    role: str
    num_waiting: int
    num_running: int
    prefill_queue_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    step_seconds_ewma: float
    prefill_tokens_per_second: float
    step_samples: _containers.RepeatedCompositeFieldContainer[StepSample]
    timestamp: float
    draining: bool
    block_size: int
    max_num_seqs: int
    num_held_kv: int
    max_num_batched_tokens: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapterState]
    max_loras: int
    def __init__(self, pod_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., prefill_queue_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., step_seconds_ewma: _Optional[float] = ..., prefill_tokens_per_second: _Optional[float] = ..., step_samples: _Optional[_Iterable[_Union[StepSample, _Mapping]]] = ..., timestamp: _Optional[float] = ..., draining: _Optional[bool] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_held_kv: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapterState, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class LoRAAdapterState(_message.Message):
    __slots__ = ("name", "identity", "registered", "resident", "num_running", "num_waiting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    registered: bool
    resident: bool
    num_running: int
    num_waiting: int
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ..., registered: _Optional[bool] = ..., resident: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterResponse(_message.Message):
    __slots__ = ("identity",)
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    identity: str
    def __init__(self, identity: _Optional[str] = ...) -> None: ...

class StepSample(_message.Message):
    __slots__ = ("num_seqs", "num_context_tokens", "num_prefill_tokens", "seconds")
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_seqs: int
    num_context_tokens: int
    num_prefill_tokens: int
    seconds: float
    def __init__(self, num_seqs: _Optional[int] = ..., num_context_tokens: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("model", "pod_id", "kv_transports")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    pod_id: str
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., pod_id: _Optional[str] = ..., kv_transports: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "arrival_time", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    arrival_time: float
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., lora_name: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprobs", "num_cached_tokens", "queue_seconds", "prefill_seconds", "finished", "finish_reason", "grammar_fingerprint", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprobs: TokenLogprobs
    num_cached_tokens: int
    queue_seconds: float
    prefill_seconds: float
    finished: bool
    finish_reason: str
    grammar_fingerprint: str
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., grammar_fingerprint: _Optional[str] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("expires_unix_ms", "mac")
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    expires_unix_ms: int
    mac: bytes
    def __init__(self, expires_unix_ms: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "model", "transport", "nccl_group", "max_chunk_bytes", "kv_handle", "lora_identity")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NCCL_GROUP_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: ModelInfo
    transport: str
    nccl_group: str
    max_chunk_bytes: int
    kv_handle: KVHandle
    lora_identity: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., transport: _Optional[str] = ..., nccl_group: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., lora_identity: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "first_block_index", "num_blocks", "data", "crc32", "num_prompt_tokens", "num_computed_tokens", "num_bytes", "last", "first_token_id", "first_token_logprobs", "grammar_fingerprint", "prompt_logprobs", "draft_kv", "draft_data", "draft_crc32", "kv_group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DATA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CRC32_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block_index: int
    num_blocks: int
    data: bytes
    crc32: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_bytes: int
    last: bool
    first_token_id: int
    first_token_logprobs: TokenLogprobs
    grammar_fingerprint: str
    prompt_logprobs: PromptLogprobs
    draft_kv: bool
    draft_data: bytes
    draft_crc32: int
    kv_group: int
    def __init__(self, request_id: _Optional[str] = ..., first_block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., last: _Optional[bool] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., grammar_fingerprint: _Optional[str] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., draft_kv: _Optional[bool] = ..., draft_data: _Optional[bytes] = ..., draft_crc32: _Optional[int] = ..., kv_group: _Optional[int] = ...) -> None: ...

class SetupTransportRequest(_message.Message):
    __slots__ = ("group", "store_host", "store_port", "backend")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    group: str
    store_host: str
    store_port: int
    backend: str
    def __init__(self, group: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class SetupTransportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "prefill_from", "kv_transport", "arrival_time", "timeout_seconds", "kv_handle", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FROM_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    prefill_from: str
    kv_transport: str
    arrival_time: float
    timeout_seconds: float
    kv_handle: KVHandle
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., prefill_from: _Optional[str] = ..., kv_transport: _Optional[str] = ..., arrival_time: _Optional[float] = ..., timeout_seconds: _Optional[float] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "local_prefill", "kv_transfer_seconds", "queue_seconds", "num_cached_tokens", "prompt_logprobs", "draft_kv_shipped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    local_prefill: bool
    kv_transfer_seconds: float
    queue_seconds: float
    num_cached_tokens: int
    prompt_logprobs: PromptLogprobs
    draft_kv_shipped: bool
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., kv_transfer_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., draft_kv_shipped: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "cancel_request_id")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel_request_id: str
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("outputs", "errors", "heartbeat_seconds")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    heartbeat_seconds: float
    def __init__(self, outputs: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., heartbeat_seconds: _Optional[float] = ...) -> None: ...

class CoreCommand(_message.Message):
    __slots__ = ("add", "abort_request_id", "stop", "prefill", "pull", "end_pull_request_id", "setup_transport", "load_lora_adapter", "unload_lora_adapter", "call_id", "timeout_seconds")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    END_PULL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SETUP_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LOAD_LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    add: GenerateRequest
    abort_request_id: str
    stop: bool
    prefill: PrefillRequest
    pull: PullKVRequest
    end_pull_request_id: str
    setup_transport: SetupTransportRequest
    load_lora_adapter: LoadLoRAAdapterRequest
    unload_lora_adapter: UnloadLoRAAdapterRequest
    call_id: int
    timeout_seconds: float
    def __init__(self, add: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort_request_id: _Optional[str] = ..., stop: _Optional[bool] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., pull: _Optional[_Union[PullKVRequest, _Mapping]] = ..., end_pull_request_id: _Optional[str] = ..., setup_transport: _Optional[_Union[SetupTransportRequest, _Mapping]] = ..., load_lora_adapter: _Optional[_Union[LoadLoRAAdapterRequest, _Mapping]] = ..., unload_lora_adapter: _Optional[_Union[UnloadLoRAAdapterRequest, _Mapping]] = ..., call_id: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CoreReply(_message.Message):
    __slots__ = ("call_id", "code", "message", "found")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    found: bool
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., found: _Optional[bool] = ...) -> None: ...

class CorePullChunk(_message.Message):
    __slots__ = ("request_id", "chunk", "end", "code", "message", "num_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: KVChunk
    end: bool
    code: int
    message: str
    num_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class CoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "local_prefill", "kv_transfer_seconds", "kv_pulled_at", "kv_bytes", "queue_seconds", "prefill_seconds", "grammar_fingerprint", "prompt_logprobs", "draft_kv_shipped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    local_prefill: bool
    kv_transfer_seconds: float
    kv_pulled_at: float
    kv_bytes: int
    queue_seconds: float
    prefill_seconds: float
    grammar_fingerprint: str
    prompt_logprobs: PromptLogprobs
    draft_kv_shipped: bool
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_pulled_at: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., grammar_fingerprint: _Optional[str] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., draft_kv_shipped: _Optional[bool] = ...) -> None: ...

class StructuredOutputStats(_message.Message):
    __slots__ = ("request_kinds", "compile_seconds", "compile_cache_hits", "first_token_rejected_fingerprint", "first_token_rejected_token")
    REQUEST_KINDS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_REJECTED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_REJECTED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_kinds: _containers.RepeatedScalarFieldContainer[str]
    compile_seconds: _containers.RepeatedScalarFieldContainer[float]
    compile_cache_hits: int
    first_token_rejected_fingerprint: int
    first_token_rejected_token: int
    def __init__(self, request_kinds: _Optional[_Iterable[str]] = ..., compile_seconds: _Optional[_Iterable[float]] = ..., compile_cache_hits: _Optional[int] = ..., first_token_rejected_fingerprint: _Optional[int] = ..., first_token_rejected_token: _Optional[int] = ...) -> None: ...

class CoreStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "prefill_queue_tokens", "num_free_blocks", "num_total_blocks", "kv_cache_usage", "prefix_cache_hit_ratio", "num_preemptions", "step_seconds_ewma", "prefill_tokens_per_second", "num_steps", "first_sample_step", "samples", "num_held_kv", "lora_adapters", "max_loras", "spec_decode")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_EWMA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SAMPLE_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_KV_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    prefill_queue_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_hit_ratio: float
    num_preemptions: int
    step_seconds_ewma: float
    prefill_tokens_per_second: float
    num_steps: int
    first_sample_step: int
    samples: _containers.RepeatedCompositeFieldContainer[StepSample]
    num_held_kv: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapterState]
    max_loras: int
    spec_decode: SpecDecodeStats
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., prefill_queue_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_hit_ratio: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., step_seconds_ewma: _Optional[float] = ..., prefill_tokens_per_second: _Optional[float] = ..., num_steps: _Optional[int] = ..., first_sample_step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[StepSample, _Mapping]]] = ..., num_held_kv: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapterState, _Mapping]]] = ..., max_loras: _Optional[int] = ..., spec_decode: _Optional[_Union[SpecDecodeStats, _Mapping]] = ...) -> None: ...

class SpecDecodeStats(_message.Message):
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "acceptance_lengths")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    acceptance_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., acceptance_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class CoreReady(_message.Message):
    __slots__ = ("model", "block_size", "max_num_seqs", "max_num_batched_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class CoreEvents(_message.Message):
    __slots__ = ("outputs", "errors", "iteration_at", "step_seconds", "stats", "ready", "token_request_ids", "num_new_tokens", "token_ids", "replies", "pull_chunks", "lease_expiries", "structured_outputs")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    PULL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[CoreOutput]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    iteration_at: float
    step_seconds: _containers.RepeatedScalarFieldContainer[float]
    stats: CoreStats
    ready: CoreReady
    token_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    replies: _containers.RepeatedCompositeFieldContainer[CoreReply]
    pull_chunks: _containers.RepeatedCompositeFieldContainer[CorePullChunk]
    lease_expiries: int
    structured_outputs: StructuredOutputStats
    def __init__(self, outputs: _Optional[_Iterable[_Union[CoreOutput, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., iteration_at: _Optional[float] = ..., step_seconds: _Optional[_Iterable[float]] = ..., stats: _Optional[_Union[CoreStats, _Mapping]] = ..., ready: _Optional[_Union[CoreReady, _Mapping]] = ..., token_request_ids: _Optional[_Iterable[str]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., replies: _Optional[_Iterable[_Union[CoreReply, _Mapping]]] = ..., pull_chunks: _Optional[_Iterable[_Union[CorePullChunk, _Mapping]]] = ..., lease_expiries: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputStats, _Mapping]] = ...) -> None: ...
