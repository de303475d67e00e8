"""What the HTTP and gRPC gateways share: the daemon's calls through one
local `AsyncClient`, Triton's tensor layouts, and Triton's error statuses.

Each protocol module parses its own wire format into `InputTensor`s and
`OutputRequest`s and writes `OutputTensor`s back; everything else (which
client call, how a JSON list or raw bytes become a tensor, which status an
error code gets, each caller's share and regions: callers.py) is here, once.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Union

import numpy as np

from ..client import AsyncClient, Classification, OutputRef, RawTensor, RegionOutput, SharedMemoryRef
from ..client.regions import SegmentUnusable
from ..protocol import datatypes, errors
from ..protocol.errors import TorchpoolError
from ..protocol.names import unusable_segment
from .callers import Caller, FairShare
from .owners import OwnerKey, RegionOwner
from .tcp_table import loopback_peer_uid
from .defaults import ALLOW_CLIENT_SHM, MAX_IN_FLIGHT_PER_CALLER

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

log = logging.getLogger("torchpool.gateway")

# Triton's HTTP status for each error code (its HttpCodeFromError); anything
# else is 400. RESOURCE_EXHAUSTED is torchpool's (a client over a limit);
# DEADLINE_EXCEEDED (the daemon behind the gateway did not answer in time:
# Triton has no such code) is 504 Gateway Timeout, what gRPC's HTTP mapping
# gives DEADLINE_EXCEEDED.
_HTTP_STATUS = {errors.NOT_FOUND: 404, errors.INTERNAL: 500, errors.UNAVAILABLE: 503,
                errors.SESSION_LOST: 503, errors.UNSUPPORTED: 501, errors.RESOURCE_EXHAUSTED: 429,
                errors.DEADLINE_EXCEEDED: 504}
# ... and its gRPC status name (grpc.StatusCode member), as Triton's CodeToStatus.
_GRPC_STATUS = {errors.INVALID_ARG: "INVALID_ARGUMENT", errors.NOT_FOUND: "NOT_FOUND",
                errors.UNAVAILABLE: "UNAVAILABLE", errors.SESSION_LOST: "UNAVAILABLE",
                errors.INTERNAL: "INTERNAL", errors.UNSUPPORTED: "UNIMPLEMENTED",
                errors.ALREADY_EXISTS: "ALREADY_EXISTS", errors.CANCELLED: "CANCELLED",
                errors.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
                errors.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED"}

# Extensions a Triton client may look for in the server metadata
# ("system_shared_memory" too, and "cuda_shared_memory" on a host with GPUs, where
# --allow-client-shm lets callers use them).
EXTENSIONS = ["classification", "sequence", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "binary_tensor_data", "parameters", "statistics"]

LOAD_TIMEOUT = 3600.0      # a load may compile and warm a model: wait as long as the daemon does
CONTROL_TIMEOUT = 60.0
# An owner's session holding regions is renewed a third of its lease after
# the last renewal (the daemon closes a session idle for its lease, and its
# regions with it: broker/sessions.py); its lease as the hello said, else the
# daemon's default (--client-lease)
RENEW_PART = 3
DEFAULT_LEASE = 60.0
# How long a model's config serves raw binary requests before it is asked
# again, and how many models' configs are kept at most
CONFIG_TTL = 1.0
MAX_CONFIGS = 1024
# Requests sent to the daemon at once, kept below its per-client limit
# (--max-in-flight-per-client, 1024): more wait here instead of being refused.
MAX_IN_FLIGHT = 960


# What one request may name: a model has a handful of inputs and outputs,
# a tensor a handful of dimensions (numpy takes at most 64). Parsed requests
# travel back from the helper process (offload.py): these bound them.
MAX_TENSORS = 1024
MAX_DIMS = 64


def check_counts(model: str, inputs: int, outputs: int) -> None:
    if inputs > MAX_TENSORS or outputs > MAX_TENSORS:
        raise bad(f"request for model '{model}' names {inputs} inputs and {outputs} outputs: at most "
                  f"{MAX_TENSORS} of each")


def check_dims(model: str, name: str, dims: int) -> None:
    if dims > MAX_DIMS:
        raise bad(f"invalid shape of input '{name}' for model '{model}': {dims} dimensions, at most "
                  f"{MAX_DIMS}")


def http_status(code: str) -> int:
    return _HTTP_STATUS.get(code, 400)


def grpc_status_name(code: str) -> str:
    return _GRPC_STATUS.get(code, "UNKNOWN")


def bad(message: str) -> TorchpoolError:
    return TorchpoolError(errors.INVALID_ARG, message)


@dataclass(frozen=True)
class ShmPolicy:
    """Which system shared memory remote callers may register. The daemon
    opens a region with the gateway's rights (those of the daemon's user:
    as root, every segment on the host), so by default they may register
    none (Triton's --allow-client-shm, off since 26.04); with `allowed`,
    only keys that begin with one of `prefixes` (any key when empty)."""

    allowed: bool = ALLOW_CLIENT_SHM
    prefixes: tuple[str, ...] = ()

    def check_allowed(self) -> None:
        """Refuse a register or unregister while remote callers may use none
        (Triton's UNSUPPORTED and words; its status calls stay allowed)."""
        if not self.allowed:
            raise TorchpoolError(errors.UNSUPPORTED, "Client shared memory is disabled. Start the server "
                                                     "with '--allow-client-shm=true' to enable.")

    def check(self, name: str, key: str) -> None:
        self.check_allowed()
        # the prefix is matched on the name shm_open sees: '/x' and '//x' are 'x'
        # (Triton's 'triton_' check was passed with leading slashes)
        bare = key.lstrip("/")
        if self.prefixes and not any(bare.startswith(p.lstrip("/")) for p in self.prefixes):
            raise bad(f"failed to register system shared memory region '{name}': its key does not "
                      f"begin with a prefix this server allows (--allow-client-shm-prefix)")


# An input's bytes as the gateway holds them: views of a request (HTTP body,
# raw_input_contents), or what its values became (bytes, or an array: both
# travel back from the helper process, where views could not).
TensorBytes = Union[bytes, bytearray, memoryview, np.ndarray]


@dataclass
class InputTensor:
    """One input as a protocol parsed it: its bytes (`raw`: binary extension,
    raw_input_contents), its values (`values`: JSON data, typed contents), or
    a registered region (`region`, `byte_size`, `offset`). Parsed where the
    bytes are not (the helper process), `raw_at` says where in the HTTP body
    they are and `raw_index` which raw_input_contents entry."""

    name: str
    datatype: str
    shape: list[int]
    raw: Optional[TensorBytes] = None
    values: object = None             # a JSON array (nested or flat), or typed contents' list
    region: Optional[str] = None
    byte_size: int = 0
    offset: int = 0
    raw_at: Optional[tuple[int, int]] = None
    raw_index: Optional[int] = None


@dataclass
class OutputRequest:
    """One requested output: as JSON or binary (`binary`; None = the request's
    default), top-k classes instead of the tensor (`classification`), or
    written into a registered region."""

    name: str
    binary: Optional[bool] = None
    classification: int = 0
    region: Optional[str] = None
    byte_size: int = 0
    offset: int = 0


@dataclass
class KServeInfer:
    """One KServe v2 infer request, as a gateway parsed it: the one type both
    parsers make (HTTP: JSON, the binary extension or a raw body,
    http_binary.py; gRPC: a ModelInferRequest, grpc_requests.py) and
    `Backend.infer` takes. Binary inputs say where their bytes are until
    they are attached (`InputTensor.raw_at`, `raw_index`)."""

    model: str
    version: str                       # "" (the daemon's choice) or as the caller said
    inputs: list[InputTensor]
    outputs: Optional[list[OutputRequest]] = None   # None: every output
    id: str = ""
    binary_default: bool = False       # outputs not asked otherwise are sent binary
    sequence_id: Union[int, str] = 0   # 0 / "": no sequence
    sequence_start: bool = False
    sequence_end: bool = False
    priority: int = 0                  # 0: the model's default level
    timeout_us: int = 0                # the request's own timeout; 0: none


@dataclass
class OutputTensor:
    """One output of an answer: `array` (a view of the worker's shared memory
    until the response is written), or where it was written (`region`)."""

    name: str
    datatype: str
    shape: list[int]
    array: Optional[np.ndarray] = None
    binary: bool = False
    region: Optional[str] = None
    byte_size: int = 0
    offset: int = 0

    def data(self) -> np.ndarray:
        """`array`: an output that was not written into a region has one."""
        if self.array is None:
            raise TypeError(f"output '{self.name}' was written into region '{self.region}': it has no array")
        return self.array

    def raw(self) -> Union[bytes, memoryview]:
        """The tensor's bytes in Triton's layout (BYTES length-prefixed)."""
        array = self.data()
        if self.datatype == "BYTES":
            return datatypes.encode_bytes(array.reshape(-1).tolist())
        arr = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return arr.data.cast("B") if arr.size else b""

    def values(self) -> list:
        """The tensor's elements, flattened, as JSON values (BYTES as text)."""
        flat = self.data().reshape(-1)
        if self.datatype == "BYTES":
            return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
        if self.datatype == "BF16":
            return bf16_to_float(flat).tolist()
        return flat.tolist()


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: list[OutputTensor] = field(default_factory=list)


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float_to_bf16(values: np.ndarray) -> np.ndarray:
    u = values.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)   # round to nearest even


_EXPECTED_VALUES = {"BOOL": "true/false", "BYTES": "strings"}


def _flatten(values: object) -> list:
    if not isinstance(values, (list, tuple)):
        return [values]
    if not any(isinstance(v, (list, tuple)) for v in values):
        return list(values)
    out: list = []
    for v in values:
        out.extend(_flatten(v))
    return out


def _check_input(t: InputTensor, model: str) -> str:
    """Its datatype and shape checked; the words that name it."""
    where = f"input '{t.name}' for model '{model}'"
    if t.datatype not in datatypes.WIRE_DATATYPES:
        raise bad(f"invalid datatype '{t.datatype}' of {where}")
    if any(not isinstance(d, int) or d < 0 for d in t.shape):
        raise bad(f"invalid shape {t.shape} of {where}: dimensions must be non-negative integers")
    return where


def _buffer(data: TensorBytes) -> Buffer:
    # an array as a view of its bytes (`.data`, memoryview(array)): numpy's
    # types give arrays the buffer protocol only from Python 3.12; the client
    # takes a view of a RawTensor's data anyway
    return data.data if isinstance(data, np.ndarray) else data


def input_value(t: InputTensor, model: str) -> Union[SharedMemoryRef, RawTensor]:
    """What `AsyncClient.infer` takes for one parsed input."""
    if t.region is not None:
        _check_input(t, model)
        return SharedMemoryRef(t.region, t.byte_size, t.offset, t.datatype, tuple(t.shape))
    return RawTensor(t.datatype, tuple(t.shape), _buffer(input_bytes(t, model)))


def input_bytes(t: InputTensor, model: str) -> TensorBytes:
    """The bytes of an input given in the request (not in a region): `raw`,
    or its `values` converted to the datatype (checked as Triton does)."""
    where = _check_input(t, model)
    if t.raw is not None:
        return t.raw
    if t.values is None:
        raise bad(f"{where} has no data: give 'data', binary data or a shared-memory region")
    flat = _flatten(t.values)
    count = math.prod(t.shape)
    if len(flat) != count:
        raise bad(f"unable to parse 'data' of {where}: shape {t.shape} has {count} elements, "
                  f"got {len(flat)}")
    try:
        if t.datatype == "BYTES":
            # strings (JSON) or bytes (gRPC's bytes_contents); bytes(n) of a
            # number would be n zero bytes
            if not all(isinstance(v, (str, bytes)) for v in flat):
                raise TypeError
            items = [v.encode() if isinstance(v, str) else v for v in flat]
            return datatypes.encode_bytes(items)
        if t.datatype == "BF16":
            return _float_to_bf16(np.asarray(flat, np.float32))
        if t.datatype == "BOOL" and not all(isinstance(v, bool) for v in flat):
            raise TypeError
        arr = np.asarray(flat, dtype=datatypes.numpy_dtype(t.datatype))
    except OverflowError:
        raise bad(f"unable to parse 'data' of {where} as {t.datatype}: a value is out of the "
                  f"datatype's range") from None
    except (TypeError, ValueError):
        # numpy's own words would show Python types and reprs: say what was expected
        raise bad(f"unable to parse 'data' of {where} as {t.datatype}: expected "
                  f"{_EXPECTED_VALUES.get(t.datatype, 'numbers')}") from None
    return arr


def output_wanted(o: OutputRequest, model: str) -> Union[OutputRef, Classification, str]:
    """What `AsyncClient.infer` takes for one requested output."""
    if o.region is not None:
        if o.classification:
            raise bad(f"output '{o.name}' for model '{model}': classification into a shared-memory "
                      f"region is not supported")
        return OutputRef(o.name, o.region, o.byte_size, o.offset)
    if o.classification:
        if isinstance(o.classification, bool) or not isinstance(o.classification, int) \
                or o.classification < 0:
            raise bad(f"output '{o.name}' for model '{model}': classification must be a "
                      f"positive integer, got {o.classification!r}")
        return Classification(o.name, o.classification)
    return o.name


def output_tensor(name: str, value: Union[RegionOutput, np.ndarray, torch.Tensor], binary: bool) -> OutputTensor:
    """One value of an `InferResult` as an `OutputTensor`."""
    if isinstance(value, RegionOutput):
        return OutputTensor(name, value.datatype, list(value.shape), region=value.region,
                            byte_size=value.nbytes, offset=value.offset)
    if not isinstance(value, np.ndarray):               # a BF16 torch tensor
        import torch
        arr = value.view(torch.int16).numpy().view(np.uint16)
        return OutputTensor(name, "BF16", list(arr.shape), arr, binary)
    datatype = "BYTES" if value.dtype == object else datatypes.wire_from_numpy(value.dtype)
    return OutputTensor(name, datatype, list(value.shape), value, binary)


class Backend:
    """The daemon, as both gateways see it: one local `AsyncClient` shared by
    every HTTP connection and gRPC call of this process, whose requests each
    caller gets its share of (callers.FairShare), and a client of its own
    for each owner of regions (owners.py: a local user, or a remote caller;
    its own session: the daemon's region limit and "unregister all" are
    then that owner's alone)."""

    def __init__(self, url: str, timeout: float = CONTROL_TIMEOUT, shm: ShmPolicy = ShmPolicy(),
                 per_caller: int = MAX_IN_FLIGHT_PER_CALLER) -> None:
        self.url = url
        self.client = AsyncClient(url, timeout=timeout, local=True)
        self.timeout = timeout
        self.shm = shm
        self.share = FairShare(MAX_IN_FLIGHT, per_caller)
        self._latest: dict[str, str] = {}       # model -> the version an unversioned request runs
        self._configs: dict[tuple[str, str], tuple[float, dict]] = {}   # (model, version) -> (when, config)
        self._owners: dict[OwnerKey, RegionOwner] = {}

    async def close(self) -> None:
        for owner in list(self._owners.values()):
            await self._close_regions(owner)
        self._owners.clear()
        await self.client.aclose()

    async def forget(self, caller: Caller) -> None:
        """`caller` is gone. A user's regions stay after its last caller, until
        unregistered (its later callers find them); a caller's own (a remote
        caller's: owners.py) go with it (their session is closed)."""
        caller.gone = True
        owner, caller.owner = caller.owner, None
        if owner is None:
            return
        owner.callers.discard(caller)
        if owner.callers:
            return
        if owner.key[0] == "uid":
            async with owner.lock:          # (after a register under way: it may keep a region)
                if owner.callers:           # a connection of the user came meanwhile
                    return
                if owner.client is not None:
                    log.info("the last connection of %s closed: its %d regions stay until unregistered",
                             owner.name, owner.regions())
                elif self._owners.get(owner.key) is owner:
                    del self._owners[owner.key]     # it holds nothing
            return
        if self._owners.get(owner.key) is owner:
            del self._owners[owner.key]
        async with owner.lock:
            if owner.client is not None:
                log.info("the last connection of %s closed: its regions are unregistered", owner.name)
            await self._close_regions(owner)

    async def _owner_of(self, caller: Caller) -> RegionOwner:
        """The owner of the regions `caller` may use (owners.py), found at its
        first use of regions: a loopback peer's uid, else the caller itself.
        (The kernel's socket table is read off the event loop: it grows with
        the host's connections, and each new caller may ask once.)"""
        owner = caller.owner
        if owner is not None:
            return owner
        uid = None
        if caller.address is not None:
            uid = await asyncio.get_running_loop().run_in_executor(
                None, loopback_peer_uid, caller.address, caller.local_port)
            if caller.owner is not None:        # found meanwhile, by another call of the caller
                return caller.owner
            if caller.gone:                     # forgotten meanwhile: nothing may hold it now
                raise TorchpoolError(errors.CANCELLED, "the caller is gone")
        key: OwnerKey = ("uid", uid) if uid is not None else ("caller", id(caller))
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = RegionOwner(key, f"uid {uid}" if uid is not None else caller.name)
        owner.callers.add(caller)
        caller.owner = owner
        return owner

    # --- health and metadata ---------------------------------------------------

    async def live(self) -> bool:
        return await self.client.server_live()

    async def ready(self) -> bool:
        return await self.client.server_ready()

    async def model_ready(self, name: str, version: str = "") -> bool:
        return await self.client.model_ready(name, version or None)

    async def server_metadata(self) -> dict:
        meta = await self.client.server_metadata()
        shm = [e for e in meta.get("extensions", ()) if e in ("system_shared_memory", "cuda_shared_memory")] \
            if self.shm.allowed else []
        return {"name": meta.get("name", "torchpool"), "version": meta.get("version", ""),
                "extensions": EXTENSIONS + shm}

    async def model_metadata(self, name: str, version: str = "") -> dict:
        return await self.client.model_metadata(name, version or None)

    async def model_config(self, name: str, version: str = "") -> dict:
        return await self.client.model_config(name, version or None)

    async def recent_config(self, name: str, version: str = "") -> dict:
        """The model's config as asked at most CONFIG_TTL ago (what each raw
        binary request needs). Dropped when this gateway loads or unloads
        the model and when a request that used it fails; a load elsewhere
        (the CLI, a polled repository) shows within CONFIG_TTL."""
        key = (name, version)
        now = time.monotonic()
        hit = self._configs.get(key)
        if hit is not None and now - hit[0] < CONFIG_TTL:
            return hit[1]
        config = await self.model_config(name, version)
        if len(self._configs) >= MAX_CONFIGS:
            self._configs.clear()
        self._configs[key] = (now, config)
        return config

    def forget_config(self, name: str) -> None:
        for key in [k for k in self._configs if k[0] == name]:
            del self._configs[key]

    async def statistics(self, name: str = "", version: str = "") -> dict:
        return await self.client.statistics(name or None, version or None)

    # --- repository -------------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        index = await self.client.repository_index()
        return [m for m in index if m.get("state") == "READY"] if ready_only else index

    async def load(self, name: str, config: Optional[str] = None, files: Optional[dict] = None) -> None:
        if files:
            raise TorchpoolError(errors.UNSUPPORTED, f"load of model '{name}': file overrides "
                                                     f"({', '.join(sorted(files))}) are not supported")
        self._latest.pop(name, None)
        self.forget_config(name)
        try:
            await self.client.load(name, config, timeout=LOAD_TIMEOUT)
        finally:
            self.forget_config(name)

    async def unload(self, name: str) -> None:
        self._latest.pop(name, None)
        self.forget_config(name)
        try:
            await self.client.unload(name, timeout=LOAD_TIMEOUT)
        finally:
            self.forget_config(name)

    # --- inference ----------------------------------------------------------------

    async def infer(self, caller: Caller, call: KServeInfer,
                    sent: Optional[Callable[[], None]] = None) -> InferResponse:
        """Run one request of `caller`. The outputs of the answer view the
        worker's shared memory: write them out and drop the response (the
        views go back to the worker once garbage). `sent()`: as
        AsyncClient.infer's (not called when the request fails before)."""
        model, version, outputs, binary_default = call.model, call.version, call.outputs, call.binary_default
        values = {}
        regions = False
        for t in call.inputs:
            if t.name in values:
                raise bad(f"input '{t.name}' for model '{model}' is given twice")
            values[t.name] = input_value(t, model)
            regions = regions or t.region is not None
        wanted = None if outputs is None else [output_wanted(o, model) for o in outputs]
        regions = regions or any(o.region is not None for o in outputs or ())
        binary = {o.name: (binary_default if o.binary is None else o.binary) for o in outputs or ()}
        timeout = call.timeout_us / 1e6 if call.timeout_us else None
        # a request naming regions goes in its owner's session (the shared one
        # has none: the daemon then says which region it does not know)
        client = self.client
        if regions:
            owner = await self._owner_of(caller)
            client = owner.client or client
        await self.share.enter(caller)
        try:
            result = await client.infer(
                model, values, wanted, version or None, timeout=timeout, priority=call.priority,
                sequence_id=call.sequence_id, sequence_start=call.sequence_start, sequence_end=call.sequence_end,
                sent=sent, caller=caller)
        finally:
            self.share.leave(caller)
        tensors = [output_tensor(name, value, binary.get(name, binary_default))
                   for name, value in result.items()]
        return InferResponse(model, version or await self._version_of(model), call.id, tensors)

    async def _version_of(self, model: str) -> str:
        """The version an unversioned request of `model` ran: the newest ready
        one (Triton's default policy picks it)."""
        version = self._latest.get(model)
        if version is None:
            try:
                versions = (await self.client.model_metadata(model)).get("versions") or [""]
            except TorchpoolError:
                return ""
            version = self._latest[model] = max(versions, key=lambda v: (len(v), v))
        return version

    # --- system shared memory: each owner's own (owners.py) ------------------------

    async def register_shm(self, caller: Caller, name: str, key: str, offset: int, byte_size: int) -> None:
        self.shm.check(name, key)
        try:
            # the daemon refuses its own segments' names (broker/regions.py region_key)
            await self._register(caller, name, lambda client: client.register_system_shared_memory(
                name, key, byte_size, offset))
        except SegmentUnusable:
            # the gateway opens the segment with the daemon's rights: why it
            # failed (missing, forbidden, a symlink, its size) is not the
            # caller's to learn; one answer for all, the broker's
            raise unusable_segment(name) from None

    async def _register(self, caller: Caller, name: str, register: Callable[[AsyncClient], Awaitable[None]],
                        cuda: bool = False) -> None:
        """Register a caller's region in its owner's session (made for it,
        and renewed while it holds regions)."""
        owner = await self._owner_of(caller)
        async with owner.lock:             # one region call of an owner at a time: they are rare
            if caller.gone:
                raise TorchpoolError(errors.CANCELLED, f"region '{name}': the caller is gone")
            if owner.client is None:
                # not local: it attaches (without an arena) only to register regions
                owner.client = AsyncClient(self.url, timeout=self.timeout, local=False)
            try:
                await register(owner.client)
                (owner.cuda_names if cuda else owner.names).add(name)
                if owner.renewal is None:           # (its hello told the lease)
                    owner.renewal = asyncio.ensure_future(self._renew(owner, owner.client))
            finally:
                if not owner.regions():
                    await self._close_regions(owner)

    async def unregister_shm(self, caller: Caller, name: str = "") -> None:
        await self._unregister(caller, name, cuda=False)

    async def _unregister(self, caller: Caller, name: str, cuda: bool) -> None:
        """Unregister a caller's region of one kind (every one of that kind
        without a name); its owner's session closes once it holds none."""
        self.shm.check_allowed()
        owner = await self._owner_of(caller)
        async with owner.lock:
            if owner.client is None:
                return                      # Triton: unregistering nothing succeeds
            if cuda:
                await owner.client.unregister_cuda_shared_memory(name or None)
            else:
                await owner.client.unregister_system_shared_memory(name or None)
            names = owner.cuda_names if cuda else owner.names
            if name:
                names.discard(name)
            else:
                names.clear()
            if not owner.regions():
                await self._close_regions(owner)

    async def register_cuda_shm(self, caller: Caller, name: str, raw_handle: bytes, device_id: int,
                                byte_size: int) -> None:
        """Triton's CUDA register for a caller: its region, in its owner's
        session (as register_shm's), opened by the workers at first use."""
        self.shm.check_allowed()
        await self._register(caller, name, lambda client: client.register_cuda_shared_memory(
            name, raw_handle, device_id, byte_size), cuda=True)

    async def unregister_cuda_shm(self, caller: Caller, name: str = "") -> None:
        await self._unregister(caller, name, cuda=True)

    async def cuda_shm_status(self, caller: Caller, name: str = "") -> list[dict]:
        client = (await self._owner_of(caller)).client or self.client
        return await client.get_cuda_shared_memory_status(name or None)

    async def shm_status(self, caller: Caller, name: str = "") -> list[dict]:
        # an owner with no regions asks in the shared session, which holds none
        client = (await self._owner_of(caller)).client or self.client
        return await client.get_system_shared_memory_status(name or None)

    async def _renew(self, owner: RegionOwner, client: AsyncClient) -> None:
        """Renew the lease of the owner's session while it holds regions (until
        _close_regions): an owner idle for a lease, such as a user whose
        connections have all closed, keeps them."""
        while True:
            await asyncio.sleep(max(0.2, (client.lease_s or DEFAULT_LEASE) / RENEW_PART))
            try:
                await client.server_live()      # any call naming the session renews it
            except Exception as exc:            # the daemon is away: the next call finds out
                log.debug("renewing the session of %s's regions failed: %r", owner.name, exc)

    async def _close_regions(self, owner: RegionOwner) -> None:
        """Close the owner's session: its regions go with it."""
        client, owner.client = owner.client, None
        renewal, owner.renewal = owner.renewal, None
        owner.names.clear()
        owner.cuda_names.clear()
        if renewal is not None:
            renewal.cancel()
        if client is not None:
            await client.aclose()
