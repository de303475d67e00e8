"""Shared memory: segments, arenas, naming and cleanup."""
from .arena import Arena, ArenaFull, Block, SegmentCache
from .naming import daemon_id, remove_segments_with_prefix, remove_stale_segments, segment_prefix
from .segment import Segment, unlink_segment

__all__ = ["Arena", "ArenaFull", "Block", "Segment", "SegmentCache", "daemon_id",
           "remove_segments_with_prefix", "remove_stale_segments", "segment_prefix",
           "unlink_segment"]
