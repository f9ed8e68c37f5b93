"""Environment servers for arpo, installable on env hosts without torch.

Every server here speaks the OSWorld VM protocol (docs/concepts/environments.md), so an
actor cannot tell one from an OSWorld VM:

    pip install -e envs
    arpo-envs sim -n 8 --base-port 5100        # eight simulated desktops
    arpo-envs sim-tasks --out /tmp/sim_tasks   # OSWorld-schema task files + oracles

`server_common` holds what every server shares (auth, JSON errors, request
helpers); `sim` is the simulated desktop, `desktop` the local one, `vm` QEMU VMs.
What the two desktops share lies below both: `png` (the band PNG encoder) and `a11y`
(the namespaces of OSWorld's accessibility tree). What both fleets (N local desktops, N
VMs) share: `fleet` (their one interface: `up`,
`status`, `down` and the handle `up` returns), `fleet_records` (the typed, versioned
records of their state files and of the VM fleet's control API) and `procs` (processes:
finding, killing, free ports).
"""

__version__ = "0.1.0"
