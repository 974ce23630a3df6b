"""Step 0, the cluster: which devices exist, how they are grouped into nodes, and the links between them.

- ``devices``: the one preset table (datasheet figures cited) and its name matcher;
- ``model``: ``Cluster`` and ``Device`` (ranks numbered node by node), built-in clusters;
- ``schema``: parsing and validating the YAML/dict schema, and writing a cluster back;
- ``detect``: this machine's GPUs as specs (matched to the presets);
- ``links``: what a link between two ranks is (intra, network, bridge), its bandwidth and latency;
- ``emulation``: the time scale of emulated devices.
"""

from autopar.cluster.devices import DeviceSpec
from autopar.cluster.model import Cluster, Device, builtin, builtin_names, load

__all__ = ["Cluster", "Device", "DeviceSpec", "builtin", "builtin_names", "load"]
