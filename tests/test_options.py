"""Typed options refuse bad values before any work starts, naming the option (no processes here).

``ClusterConfig`` is what ``varuna launch`` reads (its messages name the flags);
``ManagerOptions``/``GenerationOptions`` are the manager's and a generation's settings.
"""

from __future__ import annotations

import math

import pytest

from varuna_sdk.config import ClusterConfig, ConfigError
from varuna_sdk.manager.decisions import GrowRule
from varuna_sdk.manager.options import GenerationOptions, ManagerOptions


@pytest.mark.parametrize("kw, words", [
    (dict(local=2, hosts="h.txt"), "--local, --hosts"),
    (dict(provider="gcp"), "--provider 'gcp' is not known"),
    (dict(local=0), "--local 0"),
    (dict(local="4"), "--local '4'"),
    (dict(local=2, aws_file="aws.yaml"), "--aws: options of AWS spot VMs; add --provider aws"),
    (dict(local=2, aws={"region": "us-east-1", "instance_types": ["c5.large"]}), "--region, --instance-type"),
    (dict(instances=3), "--instances: options of AWS"),
    (dict(provider="aws"), "--provider aws needs --run-dir"),
    (dict(provider="aws", run_dir="r", instances=0), "--instances 0"),
    (dict(heartbeat_interval_s=math.nan), "--heartbeat nan"),
    (dict(heartbeat_interval_s="2"), "--heartbeat '2'"),
    (dict(orphan_after_s=-1.0), "--orphan-after -1.0"),
    (dict(heartbeat_interval_s=30.0, orphan_after_s=10.0), "must exceed the manager's loss timeout, two heartbeats (60 s"),
])
def test_cluster_config_names_the_flag_that_is_wrong(kw, words):
    with pytest.raises(ConfigError) as e:
        ClusterConfig(**kw).validate()
    assert words in str(e.value), str(e.value)


def test_cluster_config_accepts_what_launch_gives():
    assert ClusterConfig().validate().local is None
    assert ClusterConfig(local=4, heartbeat_interval_s=0.5, orphan_after_s=1.5).validate().local == 4
    assert ClusterConfig(provider="aws", run_dir="runs/a", instances=2, aws={"region": "eu-west-1"}).validate()


@pytest.mark.parametrize("kw, words", [
    (dict(max_failures=-3), "max_failures=-3: give an integer >= 0"),
    (dict(max_preemptions="lots"), "max_preemptions='lots'"),
    (dict(wait_for_hosts_s=-5), "wait_for_hosts_s=-5: give a number > 0"),
    (dict(stop_timeout_s=math.inf), "stop_timeout_s=inf"),
    (dict(grow=1.1), "grow=1.1: give a GrowRule"),
    (dict(generation_options={"miss_limit": 0}), "miss_limit=0: give a number >= 1"),
    # the generation is checked with the manager's heartbeat: 2 x 5 s outlives a 6 s orphan timeout
    (dict(heartbeat_interval_s=5.0, generation_options={"orphan_after_s": 6.0}), "orphan_after_s=6.0 must exceed"),
])
def test_manager_options_name_the_option_that_is_wrong(kw, words):
    with pytest.raises(ConfigError) as e:
        ManagerOptions.merged(**kw).validate()
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("kw, words", [
    (dict(cpu_slots=0), "cpu_slots=0"), (dict(master_port=70000), "master_port=70000"),
    (dict(kill_grace_s=-1), "kill_grace_s=-1"), (dict(setup_timeout_s=0), "setup_timeout_s=0"),
    (dict(heartbeat_interval_s="2"), "heartbeat_interval_s='2'"), (dict(notice_poll_s=7200), "notice_poll_s=7200"),
])
def test_generation_options_name_the_option_that_is_wrong(kw, words):
    with pytest.raises(ValueError) as e:   # ConfigError is a ValueError
        GenerationOptions.merged(**kw).validate()
    assert words in str(e.value), str(e.value)


def test_options_merge_from_keywords_and_mappings_and_refuse_unknown_names():
    assert ManagerOptions.merged({"stop_timeout_s": 5}).stop_timeout_s == 5
    opts = ManagerOptions.merged(grow=GrowRule(min_gain=1.3), generation_options={"sink": None})
    assert opts.grow.min_gain == 1.3 and opts.generation_options.sink is None
    assert opts.validate() is opts
    with pytest.raises(TypeError, match="stop_timeout"):
        ManagerOptions.merged(stop_timeout=5)
    with pytest.raises(TypeError, match="heartbeat"):
        GenerationOptions.merged(heartbeat=1.0)
