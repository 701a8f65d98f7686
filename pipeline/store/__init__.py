"""Where a session's state lives: persisted tool results, the records of its decisions, and
reading results back.

- :mod:`.files`: the one-method :class:`ToolResultStore` protocol and the local file store;
  :mod:`.fileops`: the operating-system calls it makes, as a seam;
- :mod:`.records`: the :class:`RecordLog` protocol every record backend implements;
- :mod:`.sessions`: a session's state from one location (a directory or an object store URL);
- :mod:`.objects`, :mod:`.object_records`, :mod:`.object_reader`: the same on an object store
  (the ``objectstore`` extra), behind :mod:`.breaker`'s circuit breaker, with
  :mod:`.held_records` (what a worker holds of a record log), :mod:`.object_snapshots`
  (compacted records, so a joining worker reads a bounded number of objects) and
  :mod:`.spool` (results waiting locally while the store is down);
- :mod:`.readback`: the tool the model calls to read a persisted output back;
- :mod:`.retention` (with :mod:`.retention_files`, :mod:`.retention_conversations`): pruning a
  long-lived store.
"""

from pipeline.store.files import FileToolResultStore, StoreError, ToolResultStore
from pipeline.store.records import RecordLog
from pipeline.store.sessions import SessionStates, SessionStorage, open_session_state

__all__ = [
    "FileToolResultStore",
    "RecordLog",
    "SessionStates",
    "SessionStorage",
    "StoreError",
    "ToolResultStore",
    "open_session_state",
]
