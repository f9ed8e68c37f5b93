"""The environment boundary (`arpo.env.environment`): which provider reverts an environment,
what its runner is told, and clones that continue an episode from a saved state (a real
simulated desktop on loopback)."""

from __future__ import annotations

import asyncio

from arpo_envs.sim.server import SimConfig, running
from arpo_envs.sim.tasks import generate_tasks

from arpo.env.environment import Environment
from arpo.env.provider import DesktopProvider, FleetLink, FleetVMProvider, StaticProvider
from arpo.env.runner import RunnerConfig
from arpo.env.task import Task


def test_the_environment_chooses_the_provider_and_tells_the_runner_what_it_needs() -> None:
    async def main() -> None:
        url = "http://127.0.0.1:9"
        desktop = Environment(0, url, RunnerConfig(reset_before_setup=True))
        static = Environment(1, url, RunnerConfig())
        link = FleetLink(control=url, token="t")
        ports = {"chromium_port": 9301, "vlc_port": 9302}
        vm = Environment(2, url, provider=lambda c: FleetVMProvider(c, link, "vm0", ports=ports))
        try:
            assert type(desktop.provider) is DesktopProvider and not desktop.replaceable
            assert type(static.provider) is StaticProvider and not static.replaceable
            assert type(vm.provider) is FleetVMProvider and vm.replaceable
            # A desktop's /reset answered right before the setup: no probe before OSWorld's.
            assert not desktop.runner.probe_before_setup
            assert static.runner.probe_before_setup and vm.runner.probe_before_setup
            assert vm.runner.osworld_ports == ports and desktop.runner.osworld_ports == {}
            assert not hasattr(vm.runner, "provider")
            assert not static.can_fork and desktop.can_fork
        finally:
            for e in (desktop, static, vm):
                await e.close()

    asyncio.run(main())


def test_clones_continue_the_episode_from_the_saved_state_with_its_actions() -> None:
    raw = generate_tasks("fill_form", 1, seed=3)[0]
    task = Task.from_dict(raw, domain="sim")
    oracle = list(raw["oracle"])
    assert len(oracle) >= 4

    async def main() -> None:
        async with running([SimConfig(port=0)]) as (url,):
            env = Environment(0, url, RunnerConfig(reset_before_setup=True, sleep_scale=0.0))
            kids: list[Environment] = []
            try:
                assert await env.prepare(task) is None
                await env.runner.act(oracle[0])
                handle = await env.snapshot()
                shot = await env.client.screenshot()
                await env.runner.act(oracle[1])  # after the save: not the clones' past
                kids = await env.clones(handle, 2, task)
                assert len({k.url for k in kids} | {env.url}) == 3
                for k in kids:
                    assert k.runner.task is task and k.runner.history == [oracle[0]]
                    assert k.quarantined is env.quarantined and k.config is env.config
                    assert type(k.provider) is DesktopProvider and k.index == env.index
                    assert await k.client.screenshot() == shot  # the saved state
                # a clone plays the episode on to its end and is scored as its parent would be
                for a in [*oracle[1:], "DONE"]:
                    await kids[0].runner.act(a)
                result = await kids[0].runner.evaluate()
                assert (result.status, result.score) == ("ok", 1.0)
                await env.release(handle)
            finally:
                for k in kids:
                    await k.close()
                await env.close()

    asyncio.run(main())
