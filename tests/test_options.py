"""cnr.options: CheckpointOptions in groups, its flat keywords and reads, and the one check every
setting goes through (types, choices, Optional and Dict fields), for the library and cnr train's
config sections alike."""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest

import cnr
from cnr.errors import ConfigError
from cnr.options import (FIELD_ORDER, CheckpointOptions, EncodingOptions, FailureBudget, OptionsError,
                         PublishOptions, RetentionOptions, ScheduleOptions, TierOptions)
from cnr.types import BitPolicy, Compaction, Compression, Policy, QuantMethod

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")


def test_flat_and_grouped_spellings_build_the_same_options():
    flat = CheckpointOptions(policy="consecutive", bits=4, keep_last=3, local_dir="/nvme")
    grouped = CheckpointOptions(schedule=ScheduleOptions(policy=Policy.CONSECUTIVE), encoding=EncodingOptions(bits=4),
                                retention=RetentionOptions(keep_last=3), tier=TierOptions(local_dir="/nvme"))
    assert flat == grouped
    assert flat.bits == flat.encoding.bits == 4 and flat.keep_last == flat.retention.keep_last == 3
    assert flat.policy is Policy.CONSECUTIVE and flat.policy == "consecutive"
    assert cnr.EncodingOptions is EncodingOptions and cnr.Policy is Policy


def test_a_flat_setting_overrides_its_group_and_replace_takes_flat_settings():
    o = CheckpointOptions(encoding=EncodingOptions(bits=8, compression="none"), bits=4)
    assert (o.bits, o.compression) == (4, Compression.NONE)
    again = dataclasses.replace(o, local_dir="/x", search_kernel="eager")
    assert (again.local_dir, again.search_kernel, again.bits) == ("/x", "eager", 4)
    assert pickle.loads(pickle.dumps(again)) == again


def test_choices_take_strings_or_members_and_read_as_their_strings():
    o = CheckpointOptions(policy=Policy.FULL, bit_policy="fixed", compaction="job", quant_method="naive")
    assert o.bit_policy is BitPolicy.FIXED and o.compaction is Compaction.JOB and o.quant_method is QuantMethod.NAIVE
    assert (str(o.policy), f"{o.policy}", o.policy == "full") == ("full", "full", True)
    d = o.to_dict()
    assert list(d) == list(FIELD_ORDER)
    assert type(d["policy"]) is str and d["policy"] == "full" and type(d["failures"]) is dict


def test_a_misspelt_keyword_is_refused_naming_it_and_the_allowed_ones():
    with pytest.raises(OptionsError, match=r"unknown setting 'CheckpointOptions.bitz'; allowed: policy, bits, .*"
                                           r"or the groups schedule, encoding, writer, tier, retention, lease"):
        CheckpointOptions(bitz=4)


def test_a_keyword_given_to_the_wrong_group_names_the_group_it_belongs_to():
    with pytest.raises(OptionsError, match=r"EncodingOptions takes no setting 'keep_last' \(it is "
                                           r"RetentionOptions.keep_last\); allowed: bits, quant_method"):
        EncodingOptions(keep_last=3)
    with pytest.raises(OptionsError, match=r"EncodingOptions takes no setting 'bitz'; allowed: bits"):
        EncodingOptions(bitz=3)
    with pytest.raises(OptionsError, match=r"CheckpointOptions.encoding = RetentionOptions\(.* is not allowed; give "
                                           r"a cnr.options.EncodingOptions"):
        CheckpointOptions(encoding=RetentionOptions())


def test_an_unknown_choice_is_refused_naming_every_allowed_value():
    with pytest.raises(OptionsError, match=r"CheckpointOptions.policy = 'bogus' is not allowed; allowed: full, "
                                           r"one_shot, consecutive, intermittent"):
        CheckpointOptions(policy="bogus")
    with pytest.raises(OptionsError, match=r"CheckpointOptions.compaction = 3 is not allowed; allowed: job, external"):
        RetentionOptions(compaction=3)
    with pytest.raises(OptionsError, match=r"PublishOptions.quant_method = 'x' is not allowed; allowed: '' "
                                           r"\(the default\), naive, symmetric, adaptive"):
        PublishOptions(quant_method="x")


def test_a_wrong_type_in_an_optional_field_is_refused():
    with pytest.raises(OptionsError, match=r"CheckpointOptions.compact_at_chain_ratio = '0.5' is not allowed; it "
                                           r"must be float or None"):
        CheckpointOptions(policy="consecutive", compact_at_chain_ratio="0.5")
    assert CheckpointOptions(policy="consecutive", compact_at_chain_ratio=None).compaction_ratio() == 0.25


def test_a_dict_with_a_value_of_the_wrong_type_is_refused():
    with pytest.raises(OptionsError, match=r"CheckpointOptions.table_bits = \{'t_0': '4'\} is not allowed; it must "
                                           r"be Dict\[str, int\]"):
        CheckpointOptions(table_bits={"t_0": "4"})
    with pytest.raises(OptionsError, match=r"CheckpointOptions.failures.tolerated_restores = \{2: 1.5\} is not "
                                           r"allowed; it must be Dict\[int, int\]"):
        CheckpointOptions(failures=FailureBudget(tolerated_restores={2: 1.5}))
    with pytest.raises(OptionsError, match=r"CheckpointOptions.failures.nodes = 'a' is not allowed; it must be int"):
        CheckpointOptions(failures={"nodes": "a"})


def test_scalars_refuse_bools_and_strings():
    with pytest.raises(OptionsError, match=r"CheckpointOptions.bits = True is not allowed; it must be int"):
        CheckpointOptions(bits=True)
    with pytest.raises(OptionsError, match=r"CheckpointOptions.local_dir = None is not allowed; it must be str"):
        CheckpointOptions(local_dir=None)
    assert CheckpointOptions(lease_ttl_s=30).lease_ttl_s == 30  # an int is a number of seconds too


def test_the_config_sections_go_through_the_same_check_naming_their_keys():
    from cnr.app.config import CheckpointConfig, PublishConfig, load_config

    with pytest.raises(ConfigError, match=r"config key 'checkpoint.local_dir' = None is not allowed; it must be str"):
        CheckpointConfig(local_dir=None)
    with pytest.raises(ConfigError, match=r"config key 'checkpoint.table_bits' = \{'t': 'x'\} is not allowed; it "
                                          r"must be Dict\[str, int\]"):
        CheckpointConfig(table_bits={"t": "x"})
    with pytest.raises(ConfigError, match=r"config key 'publish.quant_method' = 'x' is not allowed"):
        PublishConfig(quant_method="x")
    with pytest.raises(ConfigError, match=r"config key 'checkpoint.compaction' = 'elsewhere' is not allowed; "
                                          r"allowed: job, external"):
        load_config(None, ["checkpoint.compaction=elsewhere"])
    section = load_config(TINY, ["checkpoint.policy=consecutive", "checkpoint.bits=4"]).checkpoint
    assert type(section.policy) is str  # kept as the file spelt it: the config a manifest records
    options = section.options(100)
    assert (options.policy, options.bits, options.expected_steps) == (Policy.CONSECUTIVE, 4, 100)
