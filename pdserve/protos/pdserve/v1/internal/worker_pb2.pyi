from pdserve_client.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_parts")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PARTS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_parts: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_parts: _Optional[int] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("request_id", "model_id", "layout", "block_hashes", "num_tokens", "first_token_id", "transport", "address", "lease_deadline_ms", "worker_id", "epoch", "draft_layout", "draft_model_id", "tensor_parallel_size", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    first_token_id: int
    transport: str
    address: str
    lease_deadline_ms: int
    worker_id: str
    epoch: int
    draft_layout: KVLayout
    draft_model_id: str
    tensor_parallel_size: int
    lora: LoRAAdapter
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., transport: _Optional[str] = ..., address: _Optional[str] = ..., lease_deadline_ms: _Optional[int] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., draft_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., draft_model_id: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "id", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    path: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora",)
    LORA_FIELD_NUMBER: _ClassVar[int]
    lora: LoRAAdapter
    def __init__(self, lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "transport", "push_address", "push_cached_tokens", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PUSH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUSH_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    transport: str
    push_address: str
    push_cached_tokens: int
    lora: LoRAAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., transport: _Optional[str] = ..., push_address: _Optional[str] = ..., push_cached_tokens: _Optional[int] = ..., lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "text", "logprobs", "finish_reason", "cached_prompt_tokens", "handoff", "prompt_logprobs", "kv_pushed")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHED_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    text: str
    logprobs: _generation_pb2.TokenLogprobs
    finish_reason: _generation_pb2.FinishReason
    cached_prompt_tokens: int
    handoff: KVHandoff
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    kv_pushed: bool
    def __init__(self, first_token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., kv_pushed: _Optional[bool] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("request_id", "first_block", "kv_head_start", "kv_head_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    kv_head_start: int
    kv_head_end: int
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("data", "offset", "total_bytes", "num_blocks")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_bytes: int
    num_blocks: int
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class StageKVRequest(_message.Message):
    __slots__ = ("request_id", "first_block", "transport", "peer_address", "kv_head_start", "kv_head_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    transport: str
    peer_address: str
    kv_head_start: int
    kv_head_end: int
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., transport: _Optional[str] = ..., peer_address: _Optional[str] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ...) -> None: ...

class StageKVResponse(_message.Message):
    __slots__ = ("handle", "total_bytes", "num_blocks")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    total_bytes: int
    num_blocks: int
    def __init__(self, handle: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropPushRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DropPushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handoff: KVHandoff
    def __init__(self, request_id: _Optional[str] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "handoff", "kv_pushed", "pushed_to", "lora", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHED_FIELD_NUMBER: _ClassVar[int]
    PUSHED_TO_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    handoff: KVHandoff
    kv_pushed: bool
    pushed_to: str
    lora: LoRAAdapter
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ..., kv_pushed: _Optional[bool] = ..., pushed_to: _Optional[str] = ..., lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVPushMessage(_message.Message):
    __slots__ = ("header", "piece", "start", "abandon")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    header: KVPushHeader
    piece: KVPushPiece
    start: KVPushStart
    abandon: KVPushAbandon
    def __init__(self, header: _Optional[_Union[KVPushHeader, _Mapping]] = ..., piece: _Optional[_Union[KVPushPiece, _Mapping]] = ..., start: _Optional[_Union[KVPushStart, _Mapping]] = ..., abandon: _Optional[_Union[KVPushAbandon, _Mapping]] = ...) -> None: ...

class KVPushAbandon(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVPushStart(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling_params", "handoff")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    handoff: KVHandoff
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class KVPushHeader(_message.Message):
    __slots__ = ("request_id", "layout", "num_blocks", "transport", "shm_segment", "first_block")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayout
    num_blocks: int
    transport: str
    shm_segment: str
    first_block: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., transport: _Optional[str] = ..., shm_segment: _Optional[str] = ..., first_block: _Optional[int] = ...) -> None: ...

class KVPushPiece(_message.Message):
    __slots__ = ("layer", "first_block", "num_blocks", "offset", "total_bytes", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_block: int
    num_blocks: int
    offset: int
    total_bytes: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("num_blocks", "total_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    total_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "cached_prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    finish_reason: _generation_pb2.FinishReason
    spec_decode_drafts: int
    spec_decode_draft_tokens: int
    spec_decode_accepted_tokens: int
    cached_prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., spec_decode_drafts: _Optional[int] = ..., spec_decode_draft_tokens: _Optional[int] = ..., spec_decode_accepted_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "role", "epoch", "num_running", "num_waiting", "num_queued_tokens", "num_free_blocks", "num_total_blocks", "model_id", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "kv_bytes_received", "kv_receive_seconds", "kv_transfers", "kv_recomputes", "kv_pushes", "lora_adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    epoch: int
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_bytes_received: int
    kv_receive_seconds: float
    kv_transfers: int
    kv_recomputes: int
    kv_pushes: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_bytes_received: _Optional[int] = ..., kv_receive_seconds: _Optional[float] = ..., kv_transfers: _Optional[int] = ..., kv_recomputes: _Optional[int] = ..., kv_pushes: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
