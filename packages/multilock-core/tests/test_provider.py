from datetime import timedelta

import pytest

from multilock.core import ConfigurationError, LeaderInfo, Provider


class Careless(Provider):
    """A provider that checks nothing itself and records what reaches it."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    async def try_acquire(self, group, participant_id, lease_duration, metadata):
        self.seen.append(("try_acquire", group, participant_id, lease_duration, metadata))
        return

    async def renew(self, group, participant_id, token, lease_duration, metadata):
        self.seen.append(("renew", lease_duration, metadata))
        return False

    async def release(self, group, participant_id, token):
        self.seen.append(("release", group))

    async def get_leader(self, group) -> LeaderInfo | None:
        self.seen.append(("get_leader", group))
        return None


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.try_acquire("bad group", "p", 1, {}),
        lambda p: p.try_acquire("g", "p/1", 1, {}),
        lambda p: p.try_acquire("g", "p", 0, {}),
        lambda p: p.try_acquire("g", "p", 1, {"k": 1}),
        lambda p: p.renew("g", "", 1, 1, {}),
        lambda p: p.renew("g", "p", 1, float("nan"), {}),
        lambda p: p.release("", "p", 1),
        lambda p: p.get_leader("x" * 256),
        lambda p: p.get_leader(group="a;b"),
        lambda p: p.release("g", "p", -1),
        lambda p: p.renew("g", "p", True, 1, {}),
        lambda p: p.renew("g", "p", "7", 1, {}),
    ],
)
async def test_base_class_rejects_bad_arguments_before_the_store(call):
    provider = Careless()
    with pytest.raises(ConfigurationError):
        await call(provider)
    assert provider.seen == []


async def test_arguments_arrive_normalised():
    provider = Careless()
    await provider.try_acquire("g", "p", timedelta(seconds=3), {"a": "b"})
    await provider.renew(group="g", participant_id="p", token=1, lease_duration=2, metadata=None)
    assert provider.seen == [("try_acquire", "g", "p", 3.0, {"a": "b"}), ("renew", 2.0, {})]


def test_subclass_of_a_subclass_is_wrapped_once():
    class Child(Careless):
        pass

    class Override(Careless):
        async def get_leader(self, group):
            return await super().get_leader(group)

    assert Child.get_leader is Careless.get_leader
    assert getattr(Override.get_leader, "__multilock_checked__", False)


def test_watch_gets_a_checked_group():
    class Watching(Careless):
        def watch(self, group):
            self.seen.append(("watch", group))
            return

    provider = Watching()
    with pytest.raises(ConfigurationError, match="group 'a b' is invalid"):
        provider.watch("a b")
    assert provider.watch("ok") is None
    assert provider.seen == [("watch", "ok")]
