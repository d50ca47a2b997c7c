"""SLURM's own notations, parsed without SLURM: host lists, tasks-per-node counts, and the port derived from a job id.

Pure functions of strings (``utils.distributed`` reads the environment and calls these), so that every notation is
tested on examples without a cluster.
"""

from __future__ import annotations

import re

from utils.errors import ConfigError

# Rendezvous port of a job started by srun without MASTER_PORT: every task of a job must compute the same one without
# talking to the others, and two jobs sharing a node should rarely collide, so it comes from the job id. The range
# stays above the well-known and registered ports most clusters use and below Linux's ephemeral range (32768+), from
# which the kernel picks the ports of outgoing connections.
DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 15000

_RANGE_PATTERN = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_PER_NODE_PATTERN = re.compile(r"^(\d+)")


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM host list, in order: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Supports what ``scontrol show hostnames`` does for the lists SLURM writes: comma-separated names, each with
    bracketed ranges and single numbers (zero padding kept), several bracket groups in one name
    (``rack[1-2]-gpu[1-2]``), and a suffix after the brackets. Anything else is a ConfigError naming the variable.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts.extend(_expand_name(name, hostlist))
    if not hosts:
        raise _bad_hostlist(hostlist, "it names no host")
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a SLURM host list: the node of task 0, where rank 0 listens for the rendezvous."""
    return expand_hostlist(hostlist)[0]


def derived_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``: ``15000 + job_id % 15000`` (15000..29999; see DERIVED_PORT_BASE)."""
    digits = job_id.split("_", 1)[0]  # an array task's id reads "1234_7"; SLURM_JOB_ID itself is a plain number
    if not digits.isdigit():
        raise ConfigError(f"environment variable SLURM_JOB_ID={job_id!r} is not a job number; set MASTER_PORT instead")
    return DERIVED_PORT_BASE + int(digits) % DERIVED_PORT_SPAN


def tasks_on_first_node(tasks_per_node: str) -> int | None:
    """The task count of the first node in ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``4(x2),3``)."""
    match = _TASKS_PER_NODE_PATTERN.match(tasks_per_node.strip())
    return int(match.group(1)) if match else None


def _split_top_level(hostlist: str) -> list[str]:
    """Split at the commas outside brackets: ``a[1,3],b`` -> ``a[1,3]``, ``b``."""
    names, depth, current = [], 0, []
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(hostlist, "a ']' closes no '['")
        if char == "," and depth == 0:
            names.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise _bad_hostlist(hostlist, "a '[' is not closed")
    names.append("".join(current))
    return [name.strip() for name in names if name.strip()]


def _expand_name(name: str, hostlist: str) -> list[str]:
    opening = name.find("[")
    if opening < 0:
        return [name]
    closing = name.index("]", opening)
    prefix, ranges, rest = name[:opening], name[opening + 1 : closing], name[closing + 1 :]
    tails = _expand_name(rest, hostlist) if rest else [""]
    return [f"{prefix}{number}{tail}" for number in _expand_ranges(ranges, hostlist) for tail in tails]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        match = _RANGE_PATTERN.match(part.strip())
        if not match:
            raise _bad_hostlist(hostlist, f"[{ranges}] holds {part!r}, not a number or a range N-M")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise _bad_hostlist(hostlist, f"the range {part!r} runs backwards")
        width = len(low_text)  # gpu[01-10]: the padding of the first number is the padding of all of them
        numbers.extend(str(number).zfill(width) for number in range(low, high + 1))
    return numbers


def _bad_hostlist(hostlist: str, reason: str) -> ConfigError:
    return ConfigError(
        f"environment variable SLURM_JOB_NODELIST={hostlist!r} is not a host list SLURM writes ({reason}); set "
        f"MASTER_ADDR to the first node's name instead"
    )
