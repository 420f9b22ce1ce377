"""Importing this module kills the process (a worker whose preload crashes)."""

import os

os._exit(7)
