// The single pybind11 translation unit: module varuna_sdk._core.
//
// Keep every pybind11 include in this file (each TU that includes pybind11 costs
// ~12 s to compile).  The C++ logic lives in plain C++17 files such as schedule.cpp.
// std::invalid_argument thrown by the C++ side surfaces in Python as ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "schedule.h"

namespace py = pybind11;

namespace {

using ActionTuple = std::tuple<int, int>;  // (kind: 0=F 1=R 2=B, micro-batch)

ActionTuple to_tuple(const varuna::Action& a) { return {static_cast<int>(a.kind), a.mb}; }

std::vector<ActionTuple> to_tuples(const std::vector<varuna::Action>& v) {
    std::vector<ActionTuple> out;
    out.reserve(v.size());
    for (const auto& a : v) out.push_back(to_tuple(a));
    return out;
}

bool resolve_recompute(varuna::Policy p, std::optional<bool> recompute) {
    return recompute.has_value() ? *recompute : varuna::default_recompute(p);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "varuna-sdk C++ core (schedule policies). Use varuna_sdk.pipeline.schedule instead.";

    m.attr("FORWARD") = static_cast<int>(varuna::ActionKind::Forward);
    m.attr("RECOMPUTE") = static_cast<int>(varuna::ActionKind::Recompute);
    m.attr("BACKWARD") = static_cast<int>(varuna::ActionKind::Backward);
    m.attr("POLICIES") = py::make_tuple("varuna", "gpipe", "1f1b");

    m.def(
        "default_recompute",
        [](const std::string& policy) { return varuna::default_recompute(varuna::parse_policy(policy)); },
        py::arg("policy"));

    m.def(
        "stage_schedule",
        [](const std::string& policy, int P, int mb, int stage, std::optional<bool> recompute) {
            const auto p = varuna::parse_policy(policy);
            return to_tuples(varuna::stage_schedule(p, P, mb, stage, resolve_recompute(p, recompute)));
        },
        py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("stage"),
        py::arg("recompute") = py::none(),
        "Static action list of one stage as [(kind, mb)], kind 0=F 1=R 2=B.");

    m.def(
        "pipeline_schedule",
        [](const std::string& policy, int P, int mb, std::optional<bool> recompute) {
            const auto p = varuna::parse_policy(policy);
            std::vector<std::vector<ActionTuple>> out;
            for (const auto& v : varuna::pipeline_schedule(p, P, mb, resolve_recompute(p, recompute)))
                out.push_back(to_tuples(v));
            return out;
        },
        py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("recompute") = py::none(),
        "Static action lists of all stages.");

    py::class_<varuna::StageScheduler>(m, "StageScheduler")
        .def(py::init([](const std::string& policy, int P, int mb, int stage, std::optional<bool> recompute) {
                 const auto p = varuna::parse_policy(policy);
                 return varuna::StageScheduler(p, P, mb, stage, resolve_recompute(p, recompute));
             }),
             py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("stage"),
             py::arg("recompute") = py::none())
        .def(
            "next",
            [](varuna::StageScheduler& s, int acts_arrived, int grads_arrived) -> std::optional<ActionTuple> {
                auto a = s.next(acts_arrived, grads_arrived);
                if (!a) return std::nullopt;
                return to_tuple(*a);
            },
            py::arg("acts_arrived"), py::arg("grads_arrived"))
        .def("remaining", [](const varuna::StageScheduler& s) { return to_tuples(s.remaining()); })
        .def("remaining_count", &varuna::StageScheduler::remaining_count)
        .def_property_readonly("done", &varuna::StageScheduler::done)
        .def_property_readonly("policy", [](const varuna::StageScheduler& s) {
            return std::string(varuna::policy_name(s.policy()));
        })
        .def_property_readonly("P", &varuna::StageScheduler::num_stages)
        .def_property_readonly("m", &varuna::StageScheduler::num_microbatches)
        .def_property_readonly("stage", &varuna::StageScheduler::stage)
        .def_property_readonly("recompute", &varuna::StageScheduler::recompute);
}
