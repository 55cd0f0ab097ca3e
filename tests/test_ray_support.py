"""The test Ray cluster's stop (tests/ray_support.py) ends every process of its cluster, by pid."""

import os
import shutil
import subprocess
import sys
import tempfile

from ray_support import _stop_cluster

# A stand-in for a Ray agent that renamed itself: neither its command line nor an environment variable
# names the cluster (HYPE_TEST_RAY=...), but its log file is open in the cluster's temp dir.
_AGENT = """
import os, sys, time
log = open(os.path.join(os.environ["LOGS"], "agent.log"), "w")
print("ready", flush=True)
time.sleep(120)
"""


def test_stop_ends_a_process_known_only_by_a_file_open_in_the_clusters_temp_dir():
    temp_dir = tempfile.mkdtemp(prefix="hray", dir="/tmp")
    env = {"PATH": os.environ["PATH"], "LOGS": temp_dir}  # the marker is no HYPE_TEST_RAY= variable
    agent = subprocess.Popen([sys.executable, "-c", _AGENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "ready"
        _stop_cluster(temp_dir)
        assert agent.wait(timeout=30) == -9  # killed by the stop (was: left running, 2 agents after a suite)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
