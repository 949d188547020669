"""Modal's ``modal.file_io``, the file API before Modal 1.4 (``sb.open`` and its
``FileIO``). Modal 1.6 removed it along with ``Sandbox.open``/``ls``/``mkdir``/``rm``
(``sb.filesystem`` replaced them); this facade keeps ``sb.open`` and friends for code
written against the older API, so this module exists with ``FileIO`` and
``FileWatchEventType``. ``replace_bytes`` and ``delete_bytes`` (which edit a file opened
``r+``, a mode not offered here) and ``watch`` are refused."""

from ._refuse import refused
from .io import FileIO
from .types import FileWatchEventType

_WHY = ("editing a file in place (mode 'r+') is not offered here; read it, change it and "
        "write it back (sb.filesystem.read_bytes/write_bytes)")
replace_bytes = refused("modal.file_io.replace_bytes", _WHY)
delete_bytes = refused("modal.file_io.delete_bytes", _WHY)

__all__ = ["FileIO", "FileWatchEventType", "delete_bytes", "replace_bytes"]
