// Pipeline schedule policies.  See schedule.h.
#include "schedule.h"

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>

namespace varuna {

namespace {

constexpr const char* kValidPolicies = "varuna, gpipe, 1f1b";

Action F(int i) { return {ActionKind::Forward, i}; }
Action R(int i) { return {ActionKind::Recompute, i}; }
Action B(int i) { return {ActionKind::Backward, i}; }
Action W(int i) { return {ActionKind::Weight, i}; }

// The static list with W(i) placed right after every B(i).
std::vector<Action> with_weight_actions(const std::vector<Action>& v) {
    std::vector<Action> out;
    out.reserve(v.size() + v.size() / 2);
    for (const Action& a : v) {
        out.push_back(a);
        if (a.kind == ActionKind::Backward) out.push_back(W(a.mb));
    }
    return out;
}

// Varuna static schedule (paper §3.2; original generate_schedule.cc).
//
// Discrete quanta.  F and R take one quantum; a backward takes two, modelled as
// `b` followed by a filler `B` that is not emitted.  Each quantum every stage picks
// one task by strict priority B > b > R > F (or idles); the dependencies created by
// all picks are applied only after every stage has picked, so they become visible
// in the next quantum:
//   F(s,i): s < P-1 -> F[s+1].push(i)   else b[s].push(i)   (last stage: no recompute)
//   b(s,i): B[s].push(i); s > 0 -> R[s-1].push(i)
//   R(s,i): b[s].push(i)
// When stage s-1 does not recompute its backward is released directly:
//   b(s,i): B[s].push(i); s > 0 -> b[s-1].push(i)
// The emitted per-stage order (F, R, and b emitted as the backward) is the schedule.
std::vector<std::vector<Action>> varuna_all_stages(int P, int m, const StageFlags& rec) {
    struct Queues {
        std::deque<int> F, R, b, B;
        bool empty() const { return F.empty() && R.empty() && b.empty() && B.empty(); }
    };
    enum Task : int { kIdle, kF, kR, kb, kB };

    std::vector<Queues> q(static_cast<std::size_t>(P));
    for (int i = 0; i < m; ++i) q[0].F.push_back(i);

    std::vector<std::vector<Action>> out(static_cast<std::size_t>(P));
    for (auto& v : out) v.reserve(static_cast<std::size_t>(3) * static_cast<std::size_t>(m));

    std::vector<Task> pick_task(static_cast<std::size_t>(P));
    std::vector<int> pick_mb(static_cast<std::size_t>(P));

    // Every quantum in which work is outstanding executes at least one task, and there
    // are at most 4*P*m tasks, so this bound is never reached by a correct simulation.
    const long long max_quanta = 4LL * P * m + 4;
    long long quanta = 0;
    auto all_empty = [&]() {
        for (const auto& s : q)
            if (!s.empty()) return false;
        return true;
    };
    while (!all_empty()) {
        if (++quanta > max_quanta)
            throw std::logic_error("varuna schedule simulation did not terminate (internal error)");
        // 1. every stage picks one task
        for (int s = 0; s < P; ++s) {
            auto& qs = q[static_cast<std::size_t>(s)];
            Task t = kIdle;
            int i = -1;
            if (!qs.B.empty()) {
                t = kB; i = qs.B.front(); qs.B.pop_front();
            } else if (!qs.b.empty()) {
                t = kb; i = qs.b.front(); qs.b.pop_front();
            } else if (!qs.R.empty()) {
                t = kR; i = qs.R.front(); qs.R.pop_front();
            } else if (!qs.F.empty()) {
                t = kF; i = qs.F.front(); qs.F.pop_front();
            }
            pick_task[static_cast<std::size_t>(s)] = t;
            pick_mb[static_cast<std::size_t>(s)] = i;
            auto& o = out[static_cast<std::size_t>(s)];
            switch (t) {
                case kF: o.push_back(F(i)); break;
                case kR: o.push_back(R(i)); break;
                case kb: o.push_back(B(i)); break;  // the backward is emitted once, as B
                default: break;                     // idle, or the unemitted filler half
            }
        }
        // 2. apply dependencies for the next quantum
        for (int s = 0; s < P; ++s) {
            const int i = pick_mb[static_cast<std::size_t>(s)];
            switch (pick_task[static_cast<std::size_t>(s)]) {
                case kF:
                    if (s < P - 1) q[static_cast<std::size_t>(s + 1)].F.push_back(i);
                    else q[static_cast<std::size_t>(s)].b.push_back(i);
                    break;
                case kb:
                    q[static_cast<std::size_t>(s)].B.push_back(i);
                    if (s > 0) {
                        auto& up = q[static_cast<std::size_t>(s - 1)];
                        (rec[static_cast<std::size_t>(s - 1)] ? up.R : up.b).push_back(i);
                    }
                    break;
                case kR:
                    q[static_cast<std::size_t>(s)].b.push_back(i);
                    break;
                default:
                    break;
            }
        }
    }
    return out;
}

// GPipe: all forwards, then all backwards, both in micro-batch order.
std::vector<Action> gpipe_stage(int P, int m, int stage, bool recompute) {
    const bool rc = recompute && stage < P - 1;
    std::vector<Action> v;
    v.reserve(static_cast<std::size_t>(rc ? 3 : 2) * static_cast<std::size_t>(m));
    for (int i = 0; i < m; ++i) v.push_back(F(i));
    for (int i = 0; i < m; ++i) {
        if (rc) v.push_back(R(i));
        v.push_back(B(i));
    }
    return v;
}

// 1F1B (PipeDream-Flush): warm-up min(P-s-1, m) forwards, steady state one F then one
// B, cool-down the remaining backwards.
std::vector<Action> one_f_one_b_stage(int P, int m, int stage, bool recompute) {
    const bool rc = recompute && stage < P - 1;
    std::vector<Action> v;
    v.reserve(static_cast<std::size_t>(rc ? 3 : 2) * static_cast<std::size_t>(m));
    auto backward = [&](int i) {
        if (rc) v.push_back(R(i));
        v.push_back(B(i));
    };
    const int warmup = std::min(P - stage - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) v.push_back(F(f));
    while (f < m) {
        v.push_back(F(f++));
        backward(b++);
    }
    while (b < m) backward(b++);
    return v;
}

}  // namespace

Policy parse_policy(const std::string& name) {
    if (name == "varuna") return Policy::Varuna;
    if (name == "gpipe") return Policy::GPipe;
    if (name == "1f1b") return Policy::OneFOneB;
    throw std::invalid_argument("unknown schedule policy '" + name + "'; valid policies are: " +
                                kValidPolicies);
}

const char* policy_name(Policy p) {
    switch (p) {
        case Policy::Varuna: return "varuna";
        case Policy::GPipe: return "gpipe";
        case Policy::OneFOneB: return "1f1b";
    }
    return "?";
}

const char* valid_policy_names() { return kValidPolicies; }

bool default_recompute(Policy p) { return p == Policy::Varuna; }

StageFlags uniform_flags(int P, bool recompute) {
    return StageFlags(static_cast<std::size_t>(std::max(P, 0)), recompute);
}

void validate_flags(int P, const StageFlags& rec) {
    if (static_cast<int>(rec.size()) != P)
        throw std::invalid_argument("per-stage recompute needs one flag per stage: P=" + std::to_string(P) +
                                    " stages, got " + std::to_string(rec.size()) + " flags");
}

void validate_cap(Policy p, int max_in_flight) {
    if (max_in_flight < 0)
        throw std::invalid_argument("max_in_flight must be >= 0 (0 = no cap), got " +
                                    std::to_string(max_in_flight));
    if (max_in_flight > 0 && p != Policy::Varuna)
        throw std::invalid_argument(std::string("an in-flight cap applies to the varuna policy only (") +
                                    policy_name(p) + " holds what it publishes); pass max_in_flight=0");
}

void validate_split(Policy p, bool split_backward) {
    if (split_backward && p != Policy::Varuna)
        throw std::invalid_argument(std::string("split_backward applies to the varuna policy only (") +
                                    policy_name(p) +
                                    " runs its backward whole, as published); pass split_backward=False");
}

void validate_shape(int P, int m) {
    if (P < 1)
        throw std::invalid_argument("P (number of pipeline stages) must be >= 1, got " +
                                    std::to_string(P));
    if (m < 1)
        throw std::invalid_argument("m (number of micro-batches per mini-batch) must be >= 1, got " +
                                    std::to_string(m));
}

void validate_stage(int P, int m, int stage) {
    validate_shape(P, m);
    if (stage < 0 || stage >= P)
        throw std::invalid_argument("stage must satisfy 0 <= stage < P (P=" + std::to_string(P) +
                                    ", valid stages 0.." + std::to_string(P - 1) + "), got " +
                                    std::to_string(stage));
}

std::vector<Action> stage_schedule(Policy policy, int P, int m, int stage, bool recompute,
                                   bool split_backward) {
    validate_stage(P, m, stage);
    return stage_schedule(policy, P, m, stage, uniform_flags(P, recompute), split_backward);
}

std::vector<Action> stage_schedule(Policy policy, int P, int m, int stage, const StageFlags& rec,
                                   bool split_backward) {
    validate_stage(P, m, stage);
    validate_flags(P, rec);
    validate_split(policy, split_backward);
    if (split_backward) return with_weight_actions(stage_schedule(policy, P, m, stage, rec, false));
    const bool r = rec[static_cast<std::size_t>(stage)];
    switch (policy) {
        case Policy::GPipe: return gpipe_stage(P, m, stage, r);
        case Policy::OneFOneB: return one_f_one_b_stage(P, m, stage, r);
        case Policy::Varuna: {
            auto all = varuna_all_stages(P, m, rec);
            return std::move(all[static_cast<std::size_t>(stage)]);
        }
    }
    throw std::invalid_argument(std::string("unknown schedule policy; valid policies are: ") +
                                kValidPolicies);
}

std::vector<std::vector<Action>> pipeline_schedule(Policy policy, int P, int m, bool recompute,
                                                   bool split_backward) {
    validate_shape(P, m);
    return pipeline_schedule(policy, P, m, uniform_flags(P, recompute), split_backward);
}

std::vector<std::vector<Action>> pipeline_schedule(Policy policy, int P, int m, const StageFlags& rec,
                                                   bool split_backward) {
    validate_shape(P, m);
    validate_flags(P, rec);
    validate_split(policy, split_backward);
    if (policy == Policy::Varuna) {
        auto all = varuna_all_stages(P, m, rec);
        if (split_backward)
            for (auto& v : all) v = with_weight_actions(v);
        return all;
    }
    std::vector<std::vector<Action>> all;
    all.reserve(static_cast<std::size_t>(P));
    for (int s = 0; s < P; ++s) all.push_back(stage_schedule(policy, P, m, s, rec));
    return all;
}

// ---------------------------------------------------------------------------------
// StageScheduler

std::vector<int> upstream_caps(Policy policy, int P, const std::vector<int>& caps) {
    if (!caps.empty() && static_cast<int>(caps.size()) != P)
        throw std::invalid_argument("max_in_flight needs one cap per stage (P=" + std::to_string(P) + ", 0 = none), got " +
                                    std::to_string(caps.size()));
    for (int c : caps) validate_cap(policy, c);
    std::vector<int> up(static_cast<std::size_t>(std::max(P, 0)), 0);
    int eff = 0;  // the effective cap of the stage before: min over the caps up to it (0 = none)
    for (int s = 0; s < P && !caps.empty(); ++s) {
        up[static_cast<std::size_t>(s)] = eff;
        const int c = caps[static_cast<std::size_t>(s)];
        if (c > 0) eff = eff > 0 ? std::min(eff, c) : c;
    }
    return up;
}

StageScheduler::StageScheduler(Policy policy, int P, int m, int stage, bool recompute,
                               bool split_backward, int max_in_flight)
    : StageScheduler(policy, P, m, stage, (validate_shape(P, m), uniform_flags(P, recompute)), split_backward,
                     max_in_flight) {}

StageScheduler::StageScheduler(Policy policy, int P, int m, int stage, const StageFlags& rec,
                               bool split_backward, int max_in_flight)
    : policy_(policy), P_(P), m_(m), stage_(stage), split_(split_backward), cap_(max_in_flight) {
    list_ = stage_schedule(policy, P, m, stage, rec, split_backward);  // validates
    validate_cap(policy, max_in_flight);
    recompute_ = rec[static_cast<std::size_t>(stage)] && stage < P - 1;  // the last stage never recomputes
    init();
}

StageScheduler::StageScheduler(Policy policy, int P, int m, int stage, const StageFlags& rec,
                               bool split_backward, const std::vector<int>& max_in_flight)
    : policy_(policy), P_(P), m_(m), stage_(stage), split_(split_backward) {
    list_ = stage_schedule(policy, P, m, stage, rec, split_backward);  // validates
    const auto up = upstream_caps(policy, P, max_in_flight);
    cap_ = max_in_flight.empty() ? 0 : max_in_flight[static_cast<std::size_t>(stage)];
    up_cap_ = up[static_cast<std::size_t>(stage)];
    recompute_ = rec[static_cast<std::size_t>(stage)] && stage < P - 1;  // the last stage never recomputes
    init();
}

StageScheduler::StageScheduler(Policy policy, int P, int m, int stage, bool recompute,
                               bool split_backward, int max_in_flight, int up_cap, std::vector<Action> list)
    : policy_(policy), P_(P), m_(m), stage_(stage), recompute_(recompute && stage < P - 1), split_(split_backward),
      cap_(max_in_flight), up_cap_(up_cap), list_(std::move(list)) {
    init();
}

void StageScheduler::init() {
    taken_.assign(list_.size(), 0);
    remaining_ = list_.size();
    skip_taken();
}

std::vector<StageScheduler> StageScheduler::for_pipeline(Policy policy, int P, int m, bool recompute,
                                                         bool split_backward) {
    validate_shape(P, m);
    return for_pipeline(policy, P, m, uniform_flags(P, recompute), split_backward, {});
}

std::vector<StageScheduler> StageScheduler::for_pipeline(Policy policy, int P, int m, const StageFlags& rec,
                                                         bool split_backward,
                                                         const std::vector<int>& max_in_flight) {
    auto lists = pipeline_schedule(policy, P, m, rec, split_backward);  // validates
    const auto up = upstream_caps(policy, P, max_in_flight);
    std::vector<StageScheduler> out;
    out.reserve(lists.size());
    for (int s = 0; s < P; ++s) {
        const auto us = static_cast<std::size_t>(s);
        out.push_back(StageScheduler(policy, P, m, s, rec[us], split_backward,
                                     max_in_flight.empty() ? 0 : max_in_flight[us], up[us], std::move(lists[us])));
    }
    return out;
}

void StageScheduler::skip_taken() {
    while (pos_ < list_.size() && taken_[pos_]) ++pos_;
    if (f_cursor_ < pos_) f_cursor_ = pos_;
    while (f_cursor_ < list_.size() &&
           (taken_[f_cursor_] || list_[f_cursor_].kind != ActionKind::Forward))
        ++f_cursor_;
}

bool StageScheduler::would_wait(const Action& a, int acts_arrived, int grads_arrived) const {
    if (a.kind == ActionKind::Forward) return stage_ > 0 && acts_arrived <= a.mb;
    if (a.kind == ActionKind::Backward || a.kind == ActionKind::Recompute)
        return stage_ < P_ - 1 && grads_arrived <= a.mb;
    return false;
}

std::size_t StageScheduler::pick(int acts_arrived, int grads_arrived) const {
    std::size_t idx = pos_;
    const Action& head = list_[pos_];
    // Varuna's opportunistic rule: the next action would wait for a gradient that has not
    // arrived (a recompute, or a backward when not recomputing) -> run a ready forward first.
    const bool waits_for_grad = head.kind == ActionKind::Recompute ||
                                (!recompute_ && head.kind == ActionKind::Backward);
    if (policy_ == Policy::Varuna && waits_for_grad && stage_ < P_ - 1 &&
        grads_arrived <= head.mb && f_cursor_ < list_.size()) {
        // Forwards are in micro-batch order, so the earliest remaining F has the
        // smallest index: if its input is not here, no later one's is either.
        const int j = list_[f_cursor_].mb;
        if (stage_ == 0 || acts_arrived > j) idx = f_cursor_;
    }
    return idx;
}

std::size_t StageScheduler::first_untaken_backward() const {
    // Backward-side actions are taken in list order (as the head, or here), so the first
    // untaken one is found from pos_ on; a W is never untaken-and-pending at once.
    for (std::size_t k = pos_; k < list_.size(); ++k)
        if (!taken_[k] && list_[k].kind != ActionKind::Forward && list_[k].kind != ActionKind::Weight) return k;
    return list_.size();
}

std::optional<Action> StageScheduler::next(int acts_arrived, int grads_arrived) {
    if (acts_arrived < 0 || grads_arrived < 0)
        throw std::invalid_argument("acts_arrived and grads_arrived must be >= 0, got " +
                                    std::to_string(acts_arrived) + " and " +
                                    std::to_string(grads_arrived));
    if (remaining_ == 0) return std::nullopt;
    std::size_t idx = list_.size();
    if (pos_ < list_.size()) idx = pick(acts_arrived, grads_arrived);
    // in-flight cap: free before taking more (a pending W first, below; else the oldest backward);
    // and never wait for an activation the capped stages upstream cannot send before they get
    // this stage's gradient of micro-batch j - up_cap_ (a wait for it would be circular)
    const bool fwd = idx < list_.size() && list_[idx].kind == ActionKind::Forward;
    const bool blocked_up = fwd && up_cap_ > 0 && acts_arrived <= list_[idx].mb && b_done_ <= list_[idx].mb - up_cap_;
    const bool full = fwd && ((cap_ > 0 && held_ >= cap_) || blocked_up);
    if (full && pending_w_.empty()) {
        const std::size_t k = first_untaken_backward();
        if (k < list_.size()) idx = k;
    }
    // zero-bubble split: deferred weight work fills the wait, or runs when it must
    if (!pending_w_.empty() &&
        (idx == list_.size() || full || static_cast<int>(pending_w_.size()) > max_deferred() ||
         would_wait(list_[idx], acts_arrived, grads_arrived))) {
        const Action w = list_[static_cast<std::size_t>(pending_w_.front())];
        pending_w_.pop_front();
        --remaining_;
        --held_;
        return w;
    }
    const Action a = list_[idx];
    taken_[idx] = 1;
    --remaining_;
    if (a.kind == ActionKind::Forward) ++held_;
    if (a.kind == ActionKind::Backward) ++b_done_;
    if (a.kind == ActionKind::Backward && !split_) --held_;
    if (split_ && a.kind == ActionKind::Backward) {
        // its W (right after it in the static list) is pending from now on
        taken_[idx + 1] = 1;
        pending_w_.push_back(static_cast<int>(idx + 1));
    }
    skip_taken();
    return a;
}

std::vector<Action> StageScheduler::remaining() const {
    std::vector<Action> v;
    v.reserve(remaining_);
    for (int k : pending_w_) v.push_back(list_[static_cast<std::size_t>(k)]);
    for (std::size_t k = pos_; k < list_.size(); ++k)
        if (!taken_[k]) v.push_back(list_[k]);
    return v;
}

}  // namespace varuna
