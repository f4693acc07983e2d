import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: on a loaded 2-core machine intra-op thread hand-offs dominate (up to 100x
    slower than one thread). Restored afterwards for other modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# The slow tier (`pytest -m slow`); `make test-fast` runs `-m "not slow"`. Tests are marked here,
# in one place, not with decorators in their files: whole runs, subprocesses, process groups and
# bad-input corpora, and tests that took about 1 s or more on 2 shared cores, leaving the fast
# tier a quick test of every part. An entry is a module, a test function (every parameter) or
# a parameter id's start; tests/test_slow_list.py checks that each still names a test.
SLOW = (
    # a recipe's budget, Ray clusters, killed-and-resumed runs, process groups, torchrun
    "tests/rl/test_demo_robustness.py::test_a_short_budget_lifts_held_out_accuracy_under_every_rounding",
    "tests/rl/test_ray.py",  # also carries @pytest.mark.slow
    "tests/rollout/test_vllm_real.py",  # a real vLLM server (its venv built on first use)
    "tests/rl/test_eval_command.py",  # a short run, then furlong eval on it
    "tests/tasks/test_reasoning_gym_source.py::test_game_of_life_halting_pays_any_reply",
    "tests/rollout/test_vllm_server.py",  # process groups
    "tests/rollout/test_vllm_client.py::test_a_fleet_never_released_leaves_no_staging_at_exit",
    "tests/rl/test_resume.py",
    "tests/rl/test_scale_out.py::test_train_with_two_trainer_ranks",
    "tests/server/test_multirank_pool.py",
    "tests/server/test_sdk_lifecycle.py::test_save_and_sample_cycles_do_not_grow",
    "tests/server/test_sdk_auth.py::test_the_cli_flag",
    "tests/train/test_distributed.py::test_two_ranks_match_one_process",
    "tests/train/test_distributed.py::test_bad_request_raises_on_every_rank_and_the_group_goes_on",
    "tests/train/test_distributed.py::test_checkpoint_reshapes_two_to_one_and_one_to_two",
    "tests/train/test_distributed.py::test_export_hf_gathers_full_weights",
    "tests/train/test_distributed.py::test_a_bf16_model_trains_fp32_shards_like_one_process_masters",
    "tests/train/test_torchrun.py",
    # bad-input corpora: hundreds of requests (test_proto, test_hardening and test_sessions keep
    # a quick share of bad input in the fast tier)
    "tests/server/test_malformed_corpus.py",
    "tests/rollout/test_sessions_bad_input.py",
    "tests/rollout/test_server_bad_input.py",
    # short RL runs (test_loop's no-signal step stays fast)
    "tests/rl/test_loop.py::test_grpo_trains_publishes_and_writes_its_outputs",
    "tests/rl/test_loop.py::test_ppo_with_a_critic_trains_both_and_hands_off",
    "tests/rl/test_loop.py::test_moe_with_top_p_and_kl_replays_masks_and_routes",
    "tests/rl/test_loop.py::test_muon_with_disk_state_and_colocation",
    "tests/rl/test_loop.py::test_rollout_correction_scores_every_step_with_the_trainer",
    "tests/rl/test_lora_train.py::test_a_lora_run_trains_the_adapter_and_exports_merged_and_adapter",
    "tests/rl/test_lora_train.py::test_an_adapter_exported_after_a_warm_up_loads_on_the_exported_base",
    "tests/rl/test_adapter_base.py",
    "tests/rl/test_warmup_log.py::test_a_crash_at_step_k_keeps_the_first_k_records",
    "tests/rl/test_warmup_log.py::test_without_progress_bars_a_status_line_comes_every_interval",
    "tests/rl/test_plugins.py::test_a_run_logs_the_plugin_rewards",
    "tests/rl/test_plugins.py::test_the_documented_example_runs",
    "tests/rl/test_rollout_choice.py::test_a_fleet_samples_like_the_embedded_engine_and_takes_weights_everywhere",
    "tests/rollout/test_sessions_example.py",
    "tests/test_cli.py::test_demo_smoke",
    "tests/test_doc_commands.py::test_the_recipe_cpu_smoke_runs",
    # servers and CLIs in subprocesses (the two init-model tests share one fixture of them)
    "tests/test_cli.py::test_init_model_subprocess",
    "tests/test_cli.py::test_bad_preset_subprocess",
    "tests/test_cli_errors.py::test_a_user_error_is_one_line[flag after overrides]",  # builds a run
    "tests/test_quiet_runs.py",  # init-model and a train run, checked for what they print
    "tests/test_cli_model_names.py::test_serve_under_a_hub_name_starts_and_says_where_its_state_goes",
    "tests/test_cli_model_names.py::test_rollout_server_ready_line_names_a_url_that_answers",
    "tests/test_cli_model_names.py::test_session_server_ready_line_names_a_url_that_answers",
    "tests/train/test_group_cleanup.py",
    "tests/train/test_state_dir_cleanup.py",
    "tests/rollout/test_server.py::test_cli_serves_the_protocol",
    "tests/rollout/test_server.py::test_weights_published_across_the_process_boundary",
    "tests/server/test_sdk.py::test_cli_serves_the_sdk",
    "tests/server/test_hub_cache.py::test_hub_cache_resolves_offline_by_name",
    "tests/models/test_publish_dir.py::test_sigkill_between_fallback_renames_then_recovery",
    # docs: the site build and every example, each a fresh interpreter (4-10 s apiece)
    "tests/test_docs_site.py",
    "tests/test_docs.py::test_docs_example_runs",
    # many steps, threads or samples
    "tests/server/test_sdk.py::test_clients_training_at_once_get_what_they_get_alone",
    "tests/server/test_sdk.py::test_training_moves_the_model_and_state_round_trips",
    "tests/server/test_sdk.py::test_checkpoints_survive_a_restart",
    "tests/server/test_sdk.py::test_a_resaved_sampler_path_serves_the_new_weights",
    "tests/server/test_sdk_optimizers.py",
    "tests/server/test_protocol.py::test_a_gap_that_never_fills_fails_with_a_clear_error",
    "tests/server/test_protocol.py::test_out_of_order_arrival_runs_in_seq_order_and_retries_dedupe",
    "tests/server/test_protocol.py::test_size_limits_are_413_and_400_and_change_nothing",
    "tests/server/test_models.py::test_threads_on_one_base_match_sequential_runs",
    "tests/server/test_models.py::test_interleaved_models_match_models_trained_alone",
    "tests/server/test_hardening.py::test_a_small_sample_is_not_queued_behind_another_tenants_big_one",
    "tests/server/test_hardening.py::test_pages_cross_entropy_defaults_and_absolute_tokenizer_path",
    "tests/rollout/test_sampling.py::test_empirical_frequencies_match_the_kept_distribution",
    "tests/rollout/test_sessions_concurrency.py",
    "tests/rollout/test_sessions.py::test_bad_requests_are_4xx_and_leave_other_sessions_untouched",
    "tests/rollout/test_sglang_sessions.py::test_a_session_over_sglang_equals_one_over_the_embedded_engine",
    "tests/rollout/test_engine_control.py::test_offload_kv_cache_of_frozen_requests_then_resume",
    "tests/models/test_tokenizer.py::test_training_is_deterministic",
    "tests/test_host_memory.py",
    # the pretrained smollm2-135m (built once into the user's cache; its cache hit stays fast)
    "tests/models/test_smollm2.py::test_engine_logprobs_equal_an_hf_forward",
    "tests/models/test_smollm2.py::test_gradients_equal_hf_autograd",
    "tests/models/test_smollm2.py::test_rollout_logprobs_equal_teacher_forcing_and_stop_at_im_end",
    "tests/models/test_smollm2.py::test_chatml_template_and_exact_round_trip",
    "tests/models/test_smollm2.py::test_sft_steps_lower_held_out_nll",
    "tests/models/test_smollm2.py::test_the_name_loads_in_the_dtype_asked",
    "tests/models/test_smollm2.py::test_init_model_writes_the_cached_directory",
    "tests/models/test_smollm2.py::test_serve_the_pretrained_model_to_the_tinker_sdk",
    "tests/models/test_smollm2.py::test_without_the_wheel_the_error_names_the_package",
    "tests/models/test_smollm2.py::test_a_wheel_with_the_wrong_hash_is_refused",
    "tests/train/test_lora.py::test_smollm2_merged_head_adapter_equals_the_adapter_model",
)


def is_slow(nodeid: str) -> bool:
    """``nodeid`` (relative to the repository root) is an entry of SLOW or lies under one."""
    return any(nodeid == e or nodeid.startswith((f"{e}::", f"{e}[")) for e in SLOW)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


_EXIT: dict[str, int] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT["status"] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's finalization once the summary is out. The tinker SDK's
    heartbeat threads (and Ray's, and torch's pools) outlive their servers as daemon threads,
    and tearing them down at exit occasionally aborts the process (SIGABRT, exit 134) after a
    fully passing run: a red CI for green tests. The run's own status is what is returned."""
    if "status" in _EXIT and not config.option.collectonly:
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])
