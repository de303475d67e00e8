# Types of the C extension _streamcopy.c (its docstring says what it does).
from typing_extensions import Buffer

def copy(dst: Buffer, src: Buffer, /) -> None: ...
