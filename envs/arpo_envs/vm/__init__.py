"""QEMU VMs for arpo: the test image, one VM, and the fleet that reverts, watches and replaces them.

See `arpo-envs vm --help`. Parts, one file per job:

- `image`: the test image (debootstrap, cached by its recipe's hash);
- `guest_init`: PID 1 of the guest, which runs the local desktop's server
  (`arpo_envs.desktop.server`) inside the VM;
- `qemu`: one VM: its command line, QMP, snapshots, saved states and clones;
- `supervisor`: the fleet's state machine: golden snapshot, reverts, health, replacement,
  quarantine, snapshots and forks (`Fleet`, `FleetConfig`);
- `control`: the fleet's HTTP control API, and the fleet process that serves it;
- `fleet`: the fleet from any shell: `arpo-envs vm up` / `status` / `down`.
"""
