"""Names that reach the operating system: one rule for all of them.

A client names things the daemon hands to the OS: a registered region's
shared-memory key (`shm_open`, through posix_ipc), a model name that
becomes a directory of the repository. Such a name must be a single path
component: posix_ipc 1.3 ends the process with SIGSEGV on a NUL byte
(`posix_ipc.SharedMemory("/a\\0b")`), `open` raises on one, a `/` past
the leading one or a `..` walks out of the place the name is meant for,
and a name longer than NAME_MAX is refused by the kernel with an error that
names nothing. So every such name is checked here before it is used, and a
bad one is the client's INVALID_ARG naming what was wrong.

    check_os_name(what, value)   -> the name, without a leading '/'
    is_path_component(value)     -> whether it passes (no exception)
    check_shm_key(name, key)     -> a register call's key: Triton's key rules, then this one
    unusable_segment(name)       -> the one answer for a segment the daemon cannot use
"""
from __future__ import annotations

from typing import TypeGuard

from . import errors
from .errors import TorchpoolError

# NAME_MAX: the longest file name Linux takes (tmpfs under /dev/shm included),
# in bytes of its UTF-8 form.
MAX_NAME_BYTES = 255


def _problem(value: object) -> str:
    """What is wrong with `value` as a single path component ('' when nothing)."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if "\0" in value:
        return "holds a NUL byte"
    name = value[1:] if value.startswith("/") else value
    if not name:
        return "is empty"
    if "/" in name:
        return "holds a '/' after the leading one"
    if name in (".", ".."):
        return f"is '{name}'"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long (at most {MAX_NAME_BYTES})"
    return ""


def is_path_component(value: object) -> TypeGuard[str]:
    """Whether `value` is a name the OS can be given (see check_os_name)."""
    return not _problem(value)


def check_os_name(what: str, value: object) -> str:
    """`value` checked as a name the OS is given, its leading '/' taken off.
    `what` says whose name it is in the error ("region 'r': key")."""
    problem = _problem(value)
    if problem or not isinstance(value, str):   # (no problem: a str)
        raise TorchpoolError(errors.INVALID_ARG, f"{what} {problem}; it must be a single name "
                                                 f"of 1 to {MAX_NAME_BYTES} bytes with no NUL "
                                                 f"and no '/' after a leading one")
    return value[1:] if value.startswith("/") else value


# Triton's own segments (its Python backend's), refused as Triton refuses them
TRITON_RESERVED_PREFIX = "triton_python_backend_shm_region_"


def check_shm_key(name: str, key: object) -> str:
    """The key of a register call for region `name`, checked as Triton's
    ValidateSharedMemoryKey checks it (not only slashes; not its reserved
    prefix, leading slashes or not), in Triton's words, then as a name the
    OS is given (check_os_name: so `///x` is refused, not normalised).
    Triton's words repeat the key: only where it is slashes, or a plain name
    past them, so showing it shows nothing raw."""
    if isinstance(key, str):
        bare = key.lstrip("/")
        if not bare:
            raise TorchpoolError(errors.INVALID_ARG, f"cannot register shared memory region '{name}' - "
                                                     f"invalid shm key '{key}'")
        if bare.startswith(TRITON_RESERVED_PREFIX) and is_path_component(bare):
            raise TorchpoolError(errors.INVALID_ARG, f"cannot register shared memory region '{name}' with "
                                                     f"key '{key}' as the key contains the reserved prefix "
                                                     f"'{TRITON_RESERVED_PREFIX}'")
    return check_os_name(f"region '{name}': 'key'", key)


def unusable_segment(name: str) -> TorchpoolError:
    """The answer to a register whose segment the daemon cannot use: missing,
    forbidden, a symlink, a directory, smaller than offset + byte size. One
    text for all (Triton's for a region out of its segment's bounds), so that
    nobody maps /dev/shm by asking: the OS's reason and the size stay here."""
    return TorchpoolError(errors.INVALID_ARG, f"failed to register shared memory region '{name}': "
                                              f"invalid args")


def model_name_problem(value: object) -> str:
    """What is wrong with `value` as a model name ('' when nothing): the same
    rule, with no leading '/' or '.' (a model name is a directory of the
    repository) and no backslash."""
    problem = _problem(value)
    if problem or not isinstance(value, str):      # (_problem says what a non-string is)
        return problem
    if value.startswith("/"):
        return "begins with '/'"
    if value.startswith("."):
        return "begins with '.'"
    if "\\" in value:
        return "holds a backslash"
    return ""


def check_model_name(value: object) -> str:
    """`value` if it is a name a model can have; else INVALID_ARG saying what
    is wrong, never echoing it (a NUL or a control byte would reach logs and
    the caller's terminal as it is)."""
    problem = model_name_problem(value)
    if problem or not isinstance(value, str):
        raise TorchpoolError(errors.INVALID_ARG, model_name_error(problem))
    return value


def model_name_error(problem: str) -> str:
    return (f"invalid model name: it {problem}; a model name is a single directory name of 1 to "
            f"{MAX_NAME_BYTES} bytes with no NUL, '/' or backslash, not beginning with '.'")
