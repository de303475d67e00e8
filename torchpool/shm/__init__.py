"""Shared memory: segments, arenas, naming and cleanup."""
from .arena import Arena, ArenaFull, Block, MappedSegments
from .naming import daemon_id, remove_segments_with_prefix, remove_stale_segments, segment_prefix
from .segment import NamedSegment, Segment, unlink_segment

__all__ = ["Arena", "ArenaFull", "Block", "MappedSegments", "NamedSegment", "Segment", "daemon_id",
           "remove_segments_with_prefix", "remove_stale_segments", "segment_prefix",
           "unlink_segment"]
