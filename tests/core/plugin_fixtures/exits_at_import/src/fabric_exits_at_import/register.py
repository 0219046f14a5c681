"""Calls sys.exit() while being imported: must not end Fabric(), `fabric plugins` or `fabric run`."""

import sys

sys.exit(3)
