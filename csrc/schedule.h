// Pipeline schedule policies (Varuna, GPipe, 1F1B / PipeDream-Flush).
//
// Pure C++17, no Python types: the pybind11 module (bindings.cpp) exposes these
// to the runtime, and the simulator links them directly.
//
// A schedule is, per pipeline stage, the ordered list of actions that stage
// executes during one mini-batch (one optimizer step):
//   F(i)  forward of micro-batch i
//   R(i)  recompute (re-run the forward with autograd on, from the stashed input)
//   B(i)  backward of micro-batch i (with split_backward: its input gradient only)
//   W(i)  weight gradients of micro-batch i (only with split_backward)
// Micro-batch indices are 0-based.  The last stage never recomputes.
//
// split_backward (zero-bubble split, Qi et al. arXiv 2401.10241; Varuna policy only): every
// B(i) is followed by W(i) in the static list; at run time a stage defers W work into the gaps
// where its next action would wait for a message (StageScheduler::next), so input gradients
// reach the stage before sooner.
//
// Varuna policy: paper arXiv 2111.04007 §3.2 (original varuna/generate_schedule.cc).
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace varuna {

enum class ActionKind : int { Forward = 0, Recompute = 1, Backward = 2, Weight = 3 };

struct Action {
    ActionKind kind;
    int mb;  // micro-batch index, 0-based

    bool operator==(const Action& o) const { return kind == o.kind && mb == o.mb; }
    bool operator!=(const Action& o) const { return !(*this == o); }
};

enum class Policy : int { Varuna = 0, GPipe = 1, OneFOneB = 2 };

// "varuna" | "gpipe" | "1f1b".  Throws std::invalid_argument listing the valid names.
Policy parse_policy(const std::string& name);
const char* policy_name(Policy p);
// Comma-separated list of valid policy names, for error messages.
const char* valid_policy_names();

// varuna -> true, gpipe -> false, 1f1b -> false.
bool default_recompute(Policy p);

// Throws std::invalid_argument when split_backward is requested for a policy other than varuna
// (GPipe and 1F1B stay as published, for comparison).
void validate_split(Policy p, bool split_backward);

// Throws std::invalid_argument unless P >= 1 and m >= 1.
void validate_shape(int P, int m);
// Throws std::invalid_argument unless P >= 1, m >= 1 and 0 <= stage < P.
void validate_stage(int P, int m, int stage);

// Static action list of one stage.
//   P: number of pipeline stages, m: number of micro-batches per mini-batch,
//   stage: 0-based stage index, recompute: emit R actions on non-last stages.
//   split_backward: emit W(i) right after every B(i) (see above).
std::vector<Action> stage_schedule(Policy policy, int P, int m, int stage, bool recompute,
                                   bool split_backward = false);

// Static action lists of all P stages (index = stage).  For the Varuna policy this
// runs the quantum simulation once instead of once per stage.
std::vector<std::vector<Action>> pipeline_schedule(Policy policy, int P, int m, bool recompute,
                                                   bool split_backward = false);

// Run-time decision object for one stage.  Holds the remaining static list and hands
// out the next action given how much input has arrived so far.
class StageScheduler {
public:
    StageScheduler(Policy policy, int P, int m, int stage, bool recompute, bool split_backward = false);

    // The P schedulers of one pipeline (index = stage), identical to constructing
    // StageScheduler(policy, P, m, s, recompute) for every s, but the static schedule
    // is computed once (for the Varuna policy one quantum simulation instead of P).
    // Used by the simulator, which builds schedulers for many configurations.
    static std::vector<StageScheduler> for_pipeline(Policy policy, int P, int m, bool recompute,
                                                    bool split_backward = false);

    // acts_arrived: activations received from upstream so far (micro-batches arrive in
    //   order 0,1,2,..., so this is "activations 0..acts_arrived-1 are here").
    // grads_arrived: gradients received from downstream so far (same convention).
    // Returns the next action to execute and removes it from the remaining list, or
    // std::nullopt when the stage is done.  Throws std::invalid_argument on negative counts.
    //
    // Varuna's opportunistic rule (policy varuna only): if the next static action is
    // R(i) on a non-last stage, the gradient of i has not arrived (grads_arrived <= i)
    // and the earliest remaining F(j) has its input available (stage 0, or
    // acts_arrived > j), F(j) is returned instead (the R stays next in line).
    //
    // With split_backward a W(i) becomes pending once B(i) is handed out and is returned only
    // when the action chosen above would wait for a message that has not arrived (an F on a
    // stage > 0 whose activation is missing, a B or R on a non-last stage whose gradient is
    // missing), when only W work is left, or when more than max_deferred() are pending (each
    // pending W holds its micro-batch's activations); the earliest pending W goes first.
    std::optional<Action> next(int acts_arrived, int grads_arrived);

    // Most W actions a stage keeps pending: P - stage (the in-flight micro-batches 1F1B holds).
    int max_deferred() const { return P_ - stage_; }

    // Remaining actions in their current order.
    std::vector<Action> remaining() const;
    std::size_t remaining_count() const { return remaining_; }
    bool done() const { return remaining_ == 0; }

    Policy policy() const { return policy_; }
    int num_stages() const { return P_; }
    int num_microbatches() const { return m_; }
    int stage() const { return stage_; }
    bool recompute() const { return recompute_; }
    bool split_backward() const { return split_; }

private:
    // Trusted: `list` must be stage_schedule(policy, P, m, stage, recompute, split_backward).
    StageScheduler(Policy policy, int P, int m, int stage, bool recompute, bool split_backward,
                   std::vector<Action> list);
    void skip_taken();
    std::size_t pick(int acts_arrived, int grads_arrived) const;  // index of the non-W choice
    bool would_wait(const Action& a, int acts_arrived, int grads_arrived) const;

    Policy policy_;
    int P_, m_, stage_;
    bool recompute_;
    bool split_ = false;
    std::deque<int> pending_w_;  // indices into list_ of W actions whose B was handed out
    std::vector<Action> list_;
    std::vector<char> taken_;
    std::size_t pos_ = 0;       // first untaken index
    std::size_t f_cursor_ = 0;  // first untaken Forward index (monotone)
    std::size_t remaining_ = 0;
};

}  // namespace varuna
