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
// Recompute is chosen per stage (StageFlags, one entry per stage; the last stage's entry is
// ignored: it never recomputes), so a planner can recompute only where memory needs it.
// A stage that keeps its activations can be given an in-flight cap (max_in_flight, Varuna
// policy only): the most micro-batches whose forward has run on it and whose backward (with
// split_backward: weight gradients) has not, i.e. the live activation graphs it holds.
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

// Per-stage recompute flags, index = stage (size P; the last entry is ignored).
using StageFlags = std::vector<bool>;
// The same flag for all P stages.
StageFlags uniform_flags(int P, bool recompute);
// Throws std::invalid_argument unless rec has exactly P entries.
void validate_flags(int P, const StageFlags& rec);
// The effective cap upstream of each stage (size P): the smallest cap among the stages before it
// (0 = none).  Throws std::invalid_argument as validate_cap, or when caps is neither empty nor of
// size P.
std::vector<int> upstream_caps(Policy p, int P, const std::vector<int>& caps);
// Throws std::invalid_argument when max_in_flight < 0, or > 0 for a policy other than varuna
// (GPipe and 1F1B stay as published).  0 = no cap.
void validate_cap(Policy p, int max_in_flight);

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
// The same with recompute chosen per stage (rec: size P).  The Varuna policy's static order of a
// stage depends on which other stages recompute (the quantum simulation runs them together).
std::vector<Action> stage_schedule(Policy policy, int P, int m, int stage, const StageFlags& rec,
                                   bool split_backward = false);

// Static action lists of all P stages (index = stage).  For the Varuna policy this
// runs the quantum simulation once instead of once per stage.
std::vector<std::vector<Action>> pipeline_schedule(Policy policy, int P, int m, bool recompute,
                                                   bool split_backward = false);
std::vector<std::vector<Action>> pipeline_schedule(Policy policy, int P, int m, const StageFlags& rec,
                                                   bool split_backward = false);

// Run-time decision object for one stage.  Holds the remaining static list and hands
// out the next action given how much input has arrived so far.
class StageScheduler {
public:
    StageScheduler(Policy policy, int P, int m, int stage, bool recompute, bool split_backward = false,
                   int max_in_flight = 0);
    // Recompute per stage (rec: size P; this stage recomputes when rec[stage] and it is not the
    // last).  max_in_flight: see the header comment (0 = no cap).
    StageScheduler(Policy policy, int P, int m, int stage, const StageFlags& rec, bool split_backward,
                   int max_in_flight);
    // The caps of every stage (size P, or empty = none): this stage's is max_in_flight[stage], and
    // those upstream bound what can arrive (see next()).  Every stage of a pipeline must be built
    // with the same caps.
    StageScheduler(Policy policy, int P, int m, int stage, const StageFlags& rec, bool split_backward,
                   const std::vector<int>& max_in_flight);

    // The P schedulers of one pipeline (index = stage), identical to constructing
    // StageScheduler(policy, P, m, s, recompute) for every s, but the static schedule
    // is computed once (for the Varuna policy one quantum simulation instead of P).
    // Used by the simulator, which builds schedulers for many configurations.
    static std::vector<StageScheduler> for_pipeline(Policy policy, int P, int m, bool recompute,
                                                    bool split_backward = false);
    // Per-stage recompute (size P) and in-flight caps (size P, or empty = none).
    static std::vector<StageScheduler> for_pipeline(Policy policy, int P, int m, const StageFlags& rec,
                                                    bool split_backward, const std::vector<int>& max_in_flight);

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
    // Conversely (Varuna only), a forward whose activation has not arrived yields to the earliest
    // remaining R/B whose forward has run and whose gradient has arrived (backward work first, as in the quantum priority B > R > F).
    //
    // With split_backward a W(i) becomes pending once B(i) is handed out and is returned only
    // when the action chosen above would wait for a message that has not arrived (an F on a
    // stage > 0 whose activation is missing, a B or R on a non-last stage whose gradient is
    // missing), when only W work is left, or when more than max_deferred() are pending (each
    // pending W holds its micro-batch's activations); the earliest pending W goes first.
    //
    // In-flight cap (max_in_flight > 0): when the action chosen above is a forward and the stage
    // already holds max_in_flight micro-batches, a pending W runs if there is one, else the
    // earliest remaining backward-side action (R or B of the oldest micro-batch in flight, which
    // then waits for its gradient): memory is freed before more is taken.  The oldest in-flight
    // micro-batch always completes downstream.  A stage below capped stages never waits for an
    // activation j that they cannot send before they receive its gradient of micro-batch
    // j - c (c: the smallest cap upstream; they hold at most c in flight): it runs its oldest
    // backward-side action first.  So caps >= 1 never deadlock.
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
    int max_in_flight() const { return cap_; }
    // Micro-batches this stage holds now (forward run, backward / W not yet handed out).
    int in_flight() const { return held_; }

private:
    // Trusted: `list` must be stage_schedule(policy, P, m, stage, rec, split_backward).
    StageScheduler(Policy policy, int P, int m, int stage, bool recompute, bool split_backward,
                   int max_in_flight, int up_cap, std::vector<Action> list);
    void init();
    void skip_taken();
    std::size_t pick(int acts_arrived, int grads_arrived) const;  // index of the non-W choice
    std::size_t first_untaken_backward() const;                   // earliest untaken R or B
    bool would_wait(const Action& a, int acts_arrived, int grads_arrived) const;

    Policy policy_;
    int P_, m_, stage_;
    bool recompute_;
    bool split_ = false;
    int cap_ = 0;   // max_in_flight, 0 = none
    int held_ = 0;  // in flight now
    int up_cap_ = 0;  // effective in-flight cap of the stage before (min of the caps upstream; 0 = none)
    int b_done_ = 0;  // backwards handed out (gradients sent upstream, in micro-batch order)
    std::deque<int> pending_w_;  // indices into list_ of W actions whose B was handed out
    std::vector<Action> list_;
    std::vector<char> taken_;
    std::size_t pos_ = 0;       // first untaken index
    std::size_t f_cursor_ = 0;  // first untaken Forward index (monotone)
    std::size_t remaining_ = 0;
};

}  // namespace varuna
