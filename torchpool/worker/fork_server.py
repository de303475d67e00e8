"""Imported only by the fork server, as its last preload (broker/supervisor.py): names it in ps."""
from ..logs import set_process_title

set_process_title("torchpool forkserver")
