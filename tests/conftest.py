"""Test setup: 8 emulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# Variants that run in the slow suite only: each is a heavier sibling of a
# case the quick suite keeps, or the heaviest case of a test whose capability
# another quick test keeps (named after the arrow); `make test-slow` (and CI)
# runs them.
SLOW_VARIANTS = {
    # -> the rules' NumPy renderings (optim_gap_aware_test, optim_marin_test,
    # optim_muon_test) and the executor cases of the older rules.
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[gap_aware-pipedream-options10-2-1-1]",
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[dc_asgd_ema-pipedream-options11-2-1-1]",
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[weight_pred-pipedream-options12-2-1-1]",
    "tests/executor_update_rules_test.py::test_muon_executor_equals_oracle_on_pipedream",
    # S=4 of every schedule; quick: S=2 of all, S=4 of pipedream and zb-h1.
    "tests/executor_test.py::test_executor_equals_reference[4-gpipe]",
    "tests/executor_test.py::test_executor_equals_reference[4-1f1b]",
    "tests/executor_test.py::test_executor_equals_reference[4-2bw]",
    "tests/executor_test.py::test_executor_equals_reference[4-hetpipe]",
    "tests/executor_test.py::test_executor_equals_reference[4-timeprest]",
    "tests/executor_test.py::test_executor_equals_reference[4-zb-h2]",
    "tests/executor_test.py::test_executor_equals_reference[4-zb-async]",
    # -> gpipe, pipedream, zb-h1 (flush, asynchronous, split backward).
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[1f1b]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[2bw]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[hetpipe]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[zb-h2]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[zb-async]",
    # -> hetpipe (WSP) and pipedream.
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[hetpipe-<lambda>1]",
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[1f1b-<lambda>]",
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[timeprest-<lambda>]",
    # -> [2-1f1b] and [2-pipedream]; drain_test runs 2bw, stage_state_test zb-h1.
    "tests/executor_test.py::test_executor_equals_reference[2-2bw]",
    "tests/executor_test.py::test_executor_equals_reference[2-zb-h1]",
    # -> [2-boundaries1].
    "tests/gpipe_executor_test.py::test_gpipe_equals_unpipelined_sgd[2-boundaries2]",
    # -> wp1 with a sync policy; pipemare and spectrain alone stay quick.
    "tests/executor_update_rules_test.py::test_update_rule_with_a_sync_policy_executor_equals_oracle[pipemare-hetpipe-options0-<lambda>-2-2]",
    "tests/executor_update_rules_test.py::test_update_rule_with_a_sync_policy_executor_equals_oracle[spectrain-pipedream-options1-<lambda>-4-1]",
    # -> faults_test's bounded retention and run_path_test's step names.
    "tests/checkpoint_test.py::test_keeps_the_last_n_checkpoints",
    # -> [2-1f1b] and [2-pipedream]; stage_aux_test runs zb-h1.
    "tests/executor_test.py::test_executor_equals_reference[2-gpipe]",
    "tests/executor_test.py::test_executor_equals_reference[2-hetpipe]",
    "tests/executor_test.py::test_executor_equals_reference[2-timeprest]",
    "tests/executor_test.py::test_executor_equals_reference[2-zb-h2]",
    "tests/executor_test.py::test_executor_equals_reference[2-zb-async]",
    "tests/executor_test.py::test_executor_equals_reference[4-pipedream]",
    "tests/executor_test.py::test_executor_equals_reference[4-zb-h1]",
    # -> [timeprest].
    "tests/executor_test.py::test_executor_equals_reference_with_adam_and_uneven_stages[pipedream]",
    # -> [gpipe].
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[pipedream]",
    "tests/executor_test.py::test_residuals_equal_recompute_and_the_oracle[zb-h1]",
    # -> [1f1b-recompute]; gpipe_executor_test's [2-boundaries1].
    "tests/executor_test.py::test_synchronous_schedules_equal_unpipelined_training[zb-h1-recompute]",
    "tests/executor_test.py::test_synchronous_schedules_equal_unpipelined_training[zb-h1-residuals]",
    "tests/executor_test.py::test_synchronous_schedules_equal_unpipelined_training[zb-h2-recompute]",
    "tests/executor_test.py::test_synchronous_schedules_equal_unpipelined_training[zb-h2-residuals]",
    # -> [select_all].
    "tests/executor_test.py::test_every_tick_lowering_equals_the_oracle[cond_chain]",
    "tests/executor_test.py::test_every_tick_lowering_equals_the_oracle[flat_switch]",
    "tests/executor_test.py::test_every_tick_lowering_equals_the_oracle[nested_switch]",
    # -> [pipedream-recompute-packed] and [pipedream-recompute-stacked].
    "tests/executor_copies_test.py::test_no_tick_copies_the_gradient_accumulator[1f1b-recompute-packed]",
    "tests/executor_copies_test.py::test_no_tick_copies_the_gradient_accumulator[1f1b-recompute-stacked]",
    "tests/executor_copies_test.py::test_no_tick_copies_the_gradient_accumulator[zb-h1-residuals-packed]",
    "tests/executor_copies_test.py::test_no_tick_copies_the_gradient_accumulator[zb-h1-residuals-stacked]",
    # -> spectrain on pipedream (and the weight-prediction transforms'
    # own tests in optim_wp_test); pipemare-hetpipe with a sync policy.
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[wp2-1f1b-options1-2-2-2]",
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[spectrain_minibatch-pipedream-options6-3-1-2]",
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[pipemare-pipedream-options9-3-2-2]",
    "tests/executor_update_rules_test.py::test_update_rule_with_a_sync_policy_executor_equals_oracle[wp1-1f1b-options2-<lambda>-2-2]",
    # -> [residuals].
    "tests/boundary_test.py::test_int_ids_cross_beside_a_bf16_boundary_exactly[recompute]",
    # -> [_corrupt_emptied-corrupt].
    "tests/checkpoint_test.py::test_bad_latest_checkpoint_is_skipped_and_the_run_ends_bit_for_bit[_corrupt_flipped-checksum mismatch]",
    "tests/checkpoint_test.py::test_bad_latest_checkpoint_is_skipped_and_the_run_ends_bit_for_bit[_corrupt_truncated-corrupt]",
    # -> the other bad inputs (this one compiles a model).
    "tests/launch_test.py::test_bad_input_exits_with_one_line[args2-num_stages=6 does not fit a model of 4 blocks; valid: 1 to 4]",
    # -> [1-mlp], [1-vgg] and both at 2 and 4 stages.
    "tests/models_test.py::test_split_composes_to_the_unsplit_model[1-resnet]",
    "tests/models_test.py::test_split_composes_to_the_unsplit_model[1-transformer]",
    # -> [1].
    "tests/multihost_launch_test.py::test_a_peer_that_never_starts_is_named_in_one_line[0]",
    # -> [wp_option3-explicit] and the cheaper transforms.
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[stale_optimizer-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[dc_diagonal_ema-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[dc_full_delay2-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[basis_rotation_uni_1st-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[stale_gradients-auto]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[async_nesterov-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[wp_adam-explicit]",
    "tests/optim_nnx_sharding_test.py::test_sharded_nnx_model_trains_like_unsharded[basis_rotation-explicit]",
    # -> [variance_reduced_adam] and the cheaper transforms.
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[stale_gradients]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[wp_option2]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[stale_optimizer]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[wp_option3]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[wp_option1]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[dc_diagonal_ema]",
    "tests/optim_state_test.py::test_jit_under_explicit_auto_and_no_sharding_agree[async_nesterov]",
    # -> [wp_option1-standard] and the cheaper transforms.
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[dc_diagonal_ema-standard]",
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[stale_gradients-standard]",
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[wp_option2-standard]",
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[async_nesterov-standard]",
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[wp_option3-standard]",
    "tests/optim_state_test.py::test_orbax_round_trip_continues_bit_for_bit[stale_optimizer-standard]",
    # -> [cast_weight] and [token_ids].
    "tests/split_backward_test.py::test_bi_and_bw_equal_jax_vjp[last_stage]",
    "tests/split_backward_test.py::test_bi_and_bw_equal_jax_vjp[flax]",
    # -> [gpipe-recompute].
    "tests/stage_keys_test.py::test_dropout_executor_equals_oracle[zb-h1-residuals]",
    # -> [zb-h1-residuals].
    "tests/stage_state_test.py::test_metrics_and_state_equal_the_oracle[1f1b-recompute]",
    # -> [pipedream-<lambda>].
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[hetpipe-<lambda>0]",
    # Cases of 5-22 s on 2 cores; the test after the arrow keeps their
    # capability quick.
    # -> test_the_compiled_step_writes_the_pool_in_place and the pool figures.
    "tests/pool_test.py::test_a_pooled_stash_trains_what_a_ring_a_slot_trains[pipedream-v-1-2-2-None-_dc-slots]",
    # -> test_per_stage_scope_equals_the_oracle_on_an_asynchronous_schedule.
    "tests/scope_test.py::test_whole_model_rule_equals_unpipelined_training[gpipe-_clip-1]",
    # -> fsdp_test's cut, merge and refusals (the gathers train the same in CI).
    "tests/fsdp_test.py::test_a_version_gathered_once_a_window_trains_the_same[1f1b-adamw]",
    # -> test_a_label_tree_of_the_whole_module_fits_the_model_scope_only.
    "tests/your_model_test.py::test_path_masks_and_labels_mean_what_they_mean_unpipelined[multi_transform]",
    # -> test_a_drained_state_takes_no_further_step.
    "tests/drain_test.py::test_drain_equals_the_oracles_and_applies_every_update[2bw-2-2]",
    # -> folding_test's every schedule and update rules folded.
    "tests/folding_test.py::test_sync_policies_folded_onto_one_device_equal_the_oracle[ad_psgd]",
    # -> forward_only_test's evaluate equals the unpipelined forward.
    "tests/trainer_test.py::test_evaluation_through_the_mesh_equals_the_unpipelined_model[digits]",
    # -> lanes_test's plans (one busy slot a lane).
    "tests/lanes_test.py::test_lanes_train_what_the_slots_train_bit_for_bit[pipedream-v-1-2-2-<lambda>-recompute-1]",
    # -> the configs' policies built by hand and sdpipe's replayed groups.
    "tests/sync_test.py::test_executor_and_observed_staleness_equal_the_oracle[pipedream-<lambda>]",
    # -> folding_test's update_rules_folded[spectrain-1].
    "tests/executor_update_rules_test.py::test_update_rule_executor_equals_oracle[spectrain-pipedream-options4-3-1-1]",
    # -> [1-mlp], [2-mlp] and the others at 2 stages.
    "tests/models_test.py::test_split_composes_to_the_unsplit_model[2-transformer]",
    # -> test_partial_multihost_flags_are_a_one_line_error.
    "tests/multihost_launch_test.py::test_a_peer_that_never_starts_is_named_in_one_line[1]",
    # -> split_backward_test's test_bi_and_bw_equal_jax_vjp[token_ids].
    "tests/executor_test.py::test_split_backward_with_token_ids_equals_the_oracle[zb-h1]",
    # -> [1f1b-recompute].
    "tests/executor_test.py::test_synchronous_schedules_equal_unpipelined_training[gpipe-recompute]",
    # -> folding_test's loop and V placements and update rules folded.
    "tests/folding_test.py::test_every_schedule_folded_equals_the_oracle[1f1b-2]",
    # -> [lanes].
    "tests/pool_test.py::test_the_compiled_step_writes_the_pool_in_place[slots]",
    # -> the other launch.py refusals of this test.
    "tests/launch_test.py::test_bad_input_exits_with_one_line[args1-4 x 4 = 16 devices does not fit the 8]",
    "tests/faults_test.py::test_bad_input_is_one_line[seed=4294967296 is invalid; va]",
}

# Whole tests that run in the slow suite only, each 5 s or more on 2 cores;
# the capability after the arrow keeps a quick test.
SLOW_TESTS = {
    # -> the other launch_test and faults_test runs of launch.py.
    "tests/launch_test.py::test_default_launch_trains_to_90_percent",
    "tests/launch_test.py::test_workdir_that_is_a_file_or_read_only_is_refused",
    "tests/simulated_sync_test.py::test_a_config_row_runs_through_launch_and_logs_simulated_seconds",
    # -> checkpoint_test's resumed runs ending bit for bit.
    "tests/trainer_test.py::test_a_finished_pipedream_run_extended_equals_the_longer_run",
    "tests/run_path_test.py::test_a_workdir_with_window_named_checkpoints_resumes_bit_for_bit",
    "tests/checkpoint_test.py::test_unfinished_save_is_ignored_and_last_good_resumed",
    "tests/run_path_test.py::test_windows_where_no_minibatch_finished_log_no_loss",
    # -> drain_test.
    "tests/trainer_test.py::test_pipedream_writes_the_drained_weights",
    "tests/trainer_test.py::test_a_flush_schedules_drain_changes_nothing",
    # -> optim_wp_test, optim_dc_test and folding_test's dc on pipedream.
    "tests/executor_update_rules_test.py::test_sapipe_weight_prediction_equals_a_data_parallel_loop",
    "tests/executor_update_rules_test.py::test_sapipe_dc_compensates_its_own_delay_on_a_flush_schedule",
    "tests/executor_test.py::test_executor_passes_stale_params_to_delay_compensation",
    # -> test_gpipe_equals_unpipelined_sgd.
    "tests/gpipe_executor_test.py::test_gpipe_gradient_equals_unpipelined_gradient",
    # -> executor_copies_test's stacked layout.
    "tests/executor_test.py::test_stacked_layout_equals_packed_and_the_oracle",
    # -> sync_test's WSP executor and staleness tests.
    "tests/sync_test.py::test_wsp_observed_staleness_reaches_but_never_exceeds_s_global",
    # -> optim_dc_test's fresh gradient without stale_params.
    "tests/optim_dc_test.py::test_delay_0_at_one_stage_trains_as_without_compensation",
    # -> test_dropout_executor_equals_oracle.
    "tests/stage_keys_test.py::test_dropout_on_a_flush_schedule_equals_unpipelined_training",
    # -> checkpoint_test's test_keeps_the_last_n_checkpoints (retired
    # through deleted/, emptied after saves).
    "tests/faults_test.py::test_retired_checkpoints_do_not_pile_up_during_a_run",
    # -> checkpoint_test's extended and resumed runs ending bit for bit.
    "tests/checkpoint_test.py::test_rerunning_a_finished_workdir_changes_nothing",
    # -> checkpoint_test's signals after training and NaN-loss stop.
    "tests/checkpoint_test.py::test_stop_between_last_checkpoint_and_summary_finishes_it",
    # -> checkpoint_test's test_checkpoint_of_another_config_is_refused.
    "tests/faults_test.py::test_a_finished_run_rerun_with_another_config_is_refused",
    # -> test_state_and_metrics_follow_numpy_recursions.
    "tests/stage_state_test.py::test_cut_carries_batch_norm_statistics_like_unpipelined_training",
    # -> staleness_depth_test's steps to a target and rates by hand.
    "tests/staleness_depth_test.py::test_default_target_is_the_worst_s1_method_at_the_fraction",
    "tests/staleness_depth_test.py::test_rates_are_ranked_on_the_seeds_they_share",
    "tests/staleness_depth_test.py::test_s1_cell_of_a_rule_equal_to_the_control_is_the_controls_run",
    "tests/staleness_depth_test.py::test_kept_records_rebuild_the_same_tables_and_are_never_overwritten",
    # -> sync_test's configs built by hand and sdpipe's replayed groups.
    "tests/sync_test.py::test_connectivity_keeps_a_permanently_slow_worker_close",
    # -> split_backward_test's test_bi_and_bw_equal_jax_vjp.
    "tests/split_backward_test.py::test_split_zero_bubble_step_runs_the_matmuls_of_a_fused_backward",
    # -> the other supervise_test tests of the child's signals and output.
    "tests/supervise_test.py::test_a_signal_to_the_process_group_reaches_the_child_once",
    "tests/supervise_test.py::test_the_child_is_a_worker_and_shares_stdout",
    # -> stage_state_test's test_evaluate_reads_the_state_and_leaves_it.
    "tests/your_model_test.py::test_evaluate_keeps_each_output_dtype_and_equals_the_oracles",
    # -> test_checkpoint_of_another_config_is_refused (refused, kept).
    "tests/checkpoint_test.py::test_num_steps_below_the_checkpoint_is_refused_untouched",
    # -> checkpoint_test's test_nan_loss_stops_naming_the_step_and_keeps_last_good.
    "tests/trainer_test.py::test_a_drain_that_is_not_finite_stops_and_keeps_the_checkpoint",
}


def pytest_collection_modifyitems(config, items):
  """Marks SLOW_VARIANTS and SLOW_TESTS slow; an entry that names no test
  of a file that was collected is an error (a renamed test or parameter
  would otherwise run in the quick suite unnoticed)."""
  ids = {item.nodeid for item in items}
  families = {i.split("[")[0] for i in ids}
  files = {i.split("::")[0] for i in ids}
  whole_files = not any("::" in str(a) for a in config.args)
  stale = sorted(e for e in SLOW_VARIANTS | SLOW_TESTS
                 if whole_files and e.split("::")[0] in files
                 and e not in ids and e not in families)
  if stale:
    raise pytest.UsageError(f"tests/conftest.py names tests that do not "
                            f"exist: {', '.join(stale)}")
  for item in items:
    if item.nodeid in SLOW_VARIANTS or item.nodeid.split("[")[0] in SLOW_TESTS:
      item.add_marker(pytest.mark.slow)


