from datetime import timedelta

import pytest

from multilock.core import ConfigurationError, ElectionOptions, validate_metadata, validate_name


def test_defaults_follow_the_design():
    options = ElectionOptions()
    assert options.group == "default"
    assert options.lease_duration == 15.0
    assert options.renew_interval == pytest.approx(5.0)
    assert options.retry_interval == 2.0
    assert options.release_on_stop is True
    assert options.max_clock_drift == 0.01
    assert options.metadata == {}
    validate_name(options.participant_id, "participant_id")


def test_participant_ids_differ_between_instances():
    assert ElectionOptions().participant_id != ElectionOptions().participant_id


def test_timedelta_and_float_are_both_seconds():
    options = ElectionOptions(
        lease_duration=timedelta(seconds=30), renew_interval=5, retry_interval=timedelta(0, 3)
    )
    assert (options.lease_duration, options.renew_interval, options.retry_interval) == (30, 5, 3)


def test_short_lease_gets_a_retry_interval_it_can_keep():
    assert ElectionOptions(lease_duration=1).retry_interval == 1.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lease_duration", 0, "lease_duration must be a positive"),
        ("lease_duration", -1, "lease_duration must be a positive"),
        ("lease_duration", float("nan"), "lease_duration must be a positive"),
        ("lease_duration", float("inf"), "lease_duration must be a positive"),
        ("lease_duration", "15", "lease_duration must be seconds"),
        ("lease_duration", True, "lease_duration must be seconds"),
        ("renew_interval", timedelta(0), "renew_interval must be a positive"),
        ("retry_interval", -0.5, "retry_interval must be a positive"),
        ("max_clock_drift", 0.5, "max_clock_drift must be in [0, 0.5)"),
        ("max_clock_drift", -0.1, "max_clock_drift must be in [0, 0.5)"),
        ("release_on_stop", 1, "release_on_stop must be True or False"),
        ("group", "", "group '' is invalid"),
        ("group", "a b", "group 'a b' is invalid"),
        ("group", "x" * 256, "group 'xxxx"),
        ("group", 7, "group must be a str"),
        ("participant_id", "ünï", "participant_id 'ünï' is invalid"),
        ("participant_id", "a/b", "participant_id 'a/b' is invalid"),
        ("metadata", {"k": 1}, "metadata must map str to str"),
        ("metadata", ["k"], "metadata must be a mapping"),
        ("metadata", {"": "v"}, "metadata key of length 0"),
        ("metadata", {"k" * 256: "v"}, "metadata key of length 256"),
        ("metadata", {"k": "v" * 4001}, "has 4001 characters"),
        ("metadata", {f"k{i}": "" for i in range(101)}, "metadata has 101 entries"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ConfigurationError) as info:
        ElectionOptions(**{field: value})
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_limits_themselves_are_accepted():
    options = ElectionOptions(
        group="g" * 255,
        participant_id="A-z_0.9",
        metadata={**{f"k{i}": "" for i in range(98)}, "k" * 255: "v" * 4000},
    )
    assert len(options.metadata) == 99  # the election adds its instance nonce as the 100th


def test_metadata_leaves_room_for_the_instance_nonce_and_reserves_its_key():
    with pytest.raises(ConfigurationError, match=r"at most 99 \(it adds one of its own\)"):
        ElectionOptions(metadata={f"k{i}": "" for i in range(100)})
    with pytest.raises(ConfigurationError, match=r"'multilock\.instance' are reserved"):
        ElectionOptions(metadata={"multilock.instance": "x"})


def test_renew_interval_rule_names_the_inequality_and_values():
    with pytest.raises(ConfigurationError) as info:
        ElectionOptions(lease_duration=10, renew_interval=5)
    text = str(info.value)
    assert "2 * renew_interval < lease_duration * (1 - max_clock_drift)" in text
    assert "2 * 5 = 10" in text
    assert "10 * (1 - 0.01) = 9.9" in text


def test_renew_interval_just_inside_the_rule_is_accepted():
    assert ElectionOptions(lease_duration=10, renew_interval=4.94).renew_interval == 4.94


def test_drift_tightens_the_renew_rule():
    ElectionOptions(lease_duration=10, renew_interval=4.5, max_clock_drift=0.05)
    with pytest.raises(ConfigurationError, match="max_clock_drift"):
        ElectionOptions(lease_duration=10, renew_interval=4.5, max_clock_drift=0.2)


def test_retry_interval_may_not_exceed_the_lease():
    with pytest.raises(ConfigurationError, match=r"retry_interval must not exceed.*3 > 2"):
        ElectionOptions(lease_duration=2, retry_interval=3)


def test_options_are_frozen_and_keyword_only():
    options = ElectionOptions()
    with pytest.raises(AttributeError):
        options.group = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ElectionOptions("group")  # type: ignore[misc]


def test_from_fields_rejects_unknown_names_listing_valid_ones():
    with pytest.raises(
        ConfigurationError, match=r"unknown election option\(s\) leese.*lease_duration"
    ):
        ElectionOptions.from_fields({"leese": 3})


def test_metadata_is_copied():
    source = {"a": "b"}
    options = ElectionOptions(metadata=source)
    source["a"] = "changed"
    assert options.metadata == {"a": "b"}
    assert validate_metadata(None) == {}
