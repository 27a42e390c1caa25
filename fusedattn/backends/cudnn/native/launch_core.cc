// The native launch core of the cuDNN backend: a small C library (exported below) that the torch
// operator (torch_op.cc) calls. It is the only code that includes the cuDNN frontend, built with its
// own hidden copy of it and of libstdc++, so no other copy in the process (torch bundles one) can
// bind to it.
//
// Python builds a graph, serializes it and registers the bytes with the uid each of the call's
// buffer slots binds to. A launch is then: find the plan, take its graph on this device
// (deserialized on first use there), map slot pointers to uids, execute on the caller's stream.
// Once a device's handle and a plan's graph there exist, a launch finds them without a lock.
// The registry is bounded (Bounded, bounded.h): the least recently registered-or-used plan goes first;
// callers that keep a plan alive hold a shared_ptr to it. A launch whose pointers came before replays
// a CUDA graph of it instead of running cuDNN's execute again (replay.h).

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn_frontend.h>

#include "bounded.h"
#include "core_api.h"
#include "replay.h"

namespace cudnn_frontend {
// The frontend's dynamic-loading shim calls cuDNN through this handle; fusedattn_core_init sets it to
// the libcudnn the Python process already loaded, so both sides share one cuDNN.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fusedattn_native {

namespace fe = cudnn_frontend;

// Device ordinals below this find their handle and graphs without a lock (others take the locked path).
constexpr int32_t kMaxDevices = 64;

inline bool indexed(int32_t ordinal) { return ordinal >= 0 && ordinal < kMaxDevices; }

// A plan's id in the registry is the digest of its bytes and uids (fusedattn_core_register).
struct Plan {
    std::vector<uint8_t> blob;
    std::vector<int64_t> uids;  // one per slot, or kUnbound / kWorkspace
    std::vector<int8_t> slot_values;  // per slot: the bytes of its pass-by-value scalar, 0 a buffer, -1 unstated
    std::mutex mutex;           // guards graphs and workspace
    std::unordered_map<int32_t, std::unique_ptr<fe::graph::Graph>> graphs;  // by device
    std::unordered_map<int32_t, int64_t> workspace;                         // bytes, by device
    // The same for the launch path, lock-free: a graph is published (release) after its workspace
    // bytes are written, and stays until the plan goes.
    std::atomic<fe::graph::Graph *> ready[kMaxDevices] = {};
    int64_t ready_workspace[kMaxDevices] = {};
#if CUDNN_FRONTEND_VERSION >= 13200
    // For each pointer the graph reads, in the frontend's sorted order, the slot that gives it (-1:
    // none): a launch hands the frontend its pointer array directly, without a uid map. The same on
    // every device (one blob); written with the first graph, before it is published.
    std::vector<int32_t> order;
    std::vector<int64_t> order_uids;
    // Per pointer in that order: the bytes of the pass-by-value scalar it points to (0: a device
    // buffer). `replayable` is false when the graph's tensors could not be read to know that.
    std::vector<int8_t> value_bytes;
    bool replayable = false;
#endif
    // Replays by device (PlanReplays, below), used under that device's launch lock.
    std::unique_ptr<struct PlanReplays> replays[kMaxDevices];
    ~Plan();  // waits for a device's queued replays before their kernels' code goes
};

struct Device {
    cudnnHandle_t handle = nullptr;
    std::mutex mutex;                 // a cuDNN handle serves one launch at a time
    cudaStream_t capture = nullptr;   // where launches are captured for replays, made on first use
};

// FUSEDATTN_NATIVE_DEBUG=1: each step on stderr (what a crash report lacks).
inline void trace(const std::string &step) {
    static const bool on = [] {
        const char *value = std::getenv("FUSEDATTN_NATIVE_DEBUG");
        return value != nullptr && value[0] == '1';
    }();
    if (on) std::fprintf(stderr, "fusedattn native: %s\n", step.c_str());
}

// The process-wide state: cuDNN's library, one handle per device, the registered plans.
class Registry {
   public:
    static Registry &get() {
        static Registry &registry = *new Registry;  // never destroyed: no plan teardown while CUDA exits
        return registry;
    }

    // Loads cuDNN for the frontend from `path` (the library the process already uses). "" on success.
    std::string init(const char *path);

    // This process's cuDNN handle on `ordinal`, made on first use.
    std::string device(int32_t ordinal, Device **out);

    Bounded<Plan> plans;

   private:
    std::mutex mutex_;
    std::unordered_map<int32_t, std::unique_ptr<Device>> devices_;
    std::atomic<Device *> ready_[kMaxDevices] = {};  // devices_ once made, read without mutex_
};

// Runs `body` with `device` current, then restores the caller's device. The CUDA runtime is
// reached through the frontend's loader, as cuDNN is: the library links neither.
template <typename Body>
std::string on_device(int32_t device, Body body) {
    using SetDevice = cudaError_t (*)(int);
    static auto set_device = reinterpret_cast<SetDevice>(
        fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, "cudaSetDevice"));
    int previous = -1;
    if (fe::detail::cuda_get_device(&previous) != cudaSuccess) return "cudaGetDevice failed";
    if (previous != device && set_device(device) != cudaSuccess) {
        return "cudaSetDevice(" + std::to_string(device) + ") failed";
    }
    std::string error = body();
    if (previous != device) set_device(previous);
    return error;
}

inline std::string Registry::init(const char *path) {
    std::lock_guard<std::mutex> lock(mutex_);
    trace(std::string("loading ") + path);
    if (fe::cudnn_dlhandle != nullptr) return "";
    fe::cudnn_dlhandle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle == nullptr) {
        const char *reason = dlerror();
        return std::string("dlopen ") + path + ": " + (reason ? reason : "unknown error");
    }
    return "";
}

inline std::string Registry::device(int32_t ordinal, Device **out) {
    if (indexed(ordinal) && (*out = ready_[ordinal].load(std::memory_order_acquire)) != nullptr) return "";
    std::lock_guard<std::mutex> lock(mutex_);
    auto &slot = devices_[ordinal];
    if (!slot) {
        auto device = std::make_unique<Device>();
        trace("creating a cuDNN handle on device " + std::to_string(ordinal));
        std::string error = on_device(ordinal, [&]() -> std::string {
            cudnnStatus_t status = fe::detail::create_handle(&device->handle);
            return status == CUDNN_STATUS_SUCCESS ? "" : "cudnnCreate failed with status " + std::to_string(status);
        });
        if (!error.empty()) {
            devices_.erase(ordinal);
            return error;
        }
        slot = std::move(device);
    }
    *out = slot.get();
    if (indexed(ordinal)) ready_[ordinal].store(*out, std::memory_order_release);
    return "";
}

// FUSEDATTN_NATIVE_PROFILE=1: where a launch's host time goes, summed per step and printed at exit.
enum Step { kLookups, kBinding, kStream, kExecute, kSteps };

struct Profile {
    bool on = false;
    std::atomic<int64_t> nanoseconds[kSteps];
    std::atomic<int64_t> launches{0};
    Profile() {
        const char *value = std::getenv("FUSEDATTN_NATIVE_PROFILE");
        on = value != nullptr && value[0] == '1';
        for (auto &n : nanoseconds) n.store(0);
    }
    ~Profile() {
        if (!on || launches.load() == 0) return;
        const char *names[kSteps] = {"lookups", "binding", "set stream", "frontend execute"};
        for (int i = 0; i < kSteps; ++i) {
            std::fprintf(stderr, "fusedattn native profile: %-16s %8.2f us/launch\n", names[i],
                         nanoseconds[i].load() / 1e3 / launches.load());
        }
    }
};

inline Profile &profile() {
    static Profile instance;
    return instance;
}

class Stopwatch {
   public:
    Stopwatch() {
        if (profile().on) last_ = std::chrono::steady_clock::now();
    }
    void lap(Step step) {
        if (!profile().on) return;
        auto now = std::chrono::steady_clock::now();
        profile().nanoseconds[step] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
        if (step == kExecute) profile().launches++;
        last_ = now;
    }

   private:
    std::chrono::steady_clock::time_point last_;
};

#if CUDNN_FRONTEND_VERSION >= 13200
// The bytes of the pass-by-value scalar behind each of `uids` (0: a device buffer): as `declared` by
// the caller (-1: not stated), else as the tensors the serialized graph lists say (it omits a
// score_mod's own tensors). "" on success, else why some cannot be known: its launches never replay.
inline std::string value_sizes(const std::vector<uint8_t> &blob, const std::vector<int64_t> &uids,
                               const std::vector<int8_t> &declared, std::vector<int8_t> *sizes) {
    sizes->assign(uids.size(), 0);
    std::vector<bool> known(uids.size());
    for (size_t j = 0; j < uids.size(); ++j) {
        known[j] = declared[j] >= 0;
        if (known[j]) (*sizes)[j] = declared[j];
    }
    try {
        auto graph = json::from_ubjson(blob);
        if (graph.contains("tensors")) {
            for (auto const &tensor : graph["tensors"]) {
                auto found = std::find(uids.begin(), uids.end(), tensor.at("uid").get<int64_t>());
                if (found == uids.end() || known[found - uids.begin()]) continue;
                known[found - uids.begin()] = true;
                if (!tensor.at("is_pass_by_value").get<bool>()) continue;
                size_t bytes = fe::detail::get_data_type_size(tensor.at("data_type").get<fe::DataType_t>());
                if (bytes == 0) return "a pass-by-value tensor of data type " + tensor.at("data_type").dump();
                (*sizes)[found - uids.begin()] = static_cast<int8_t>(bytes);
            }
        }
    } catch (const std::exception &error) {
        return std::string("reading the serialized graph: ") + error.what();
    }
    for (size_t j = 0; j < uids.size(); ++j) {
        if (!known[j]) return "uid " + std::to_string(uids[j]) + " is neither a stated slot nor a listed tensor";
    }
    return "";
}
#endif

// The plan's graph on `ordinal`, deserialized on first use there; its workspace bytes in *workspace.
inline std::string graph_on(Plan *plan, int32_t ordinal, Device *device, fe::graph::Graph **out,
                            int64_t *workspace) {
    if (indexed(ordinal) && (*out = plan->ready[ordinal].load(std::memory_order_acquire)) != nullptr) {
        *workspace = plan->ready_workspace[ordinal];
        return "";
    }
    std::lock_guard<std::mutex> lock(plan->mutex);
    auto &slot = plan->graphs[ordinal];
    if (!slot) {
        trace("deserializing a " + std::to_string(plan->blob.size()) + "-byte plan on device " +
              std::to_string(ordinal));
        auto graph = std::make_unique<fe::graph::Graph>();
        std::string error = on_device(ordinal, [&]() -> std::string {
            std::lock_guard<std::mutex> handle_lock(device->mutex);
            auto status = graph->deserialize(device->handle, plan->blob, false, /*run_warmup=*/false);
            return status.is_good() ? "" : "deserialize: " + status.get_message();
        });
        if (!error.empty()) {
            plan->graphs.erase(ordinal);
            return error;
        }
        plan->workspace[ordinal] = graph->get_workspace_size();
        trace("deserialized; workspace " + std::to_string(plan->workspace[ordinal]) + " bytes");
#if CUDNN_FRONTEND_VERSION >= 13200
        if (plan->order_uids.empty()) {
            plan->order_uids = graph->get_variant_pack_uids_sorted();
            for (int64_t uid : plan->order_uids) {
                auto found = std::find(plan->uids.begin(), plan->uids.end(), uid);
                plan->order.push_back(found == plan->uids.end() ? -1
                                                                : static_cast<int32_t>(found - plan->uids.begin()));
            }
            std::vector<int8_t> declared;
            for (int32_t slot : plan->order) declared.push_back(slot < 0 ? -1 : plan->slot_values[slot]);
            std::string unknown = value_sizes(plan->blob, plan->order_uids, declared, &plan->value_bytes);
            plan->replayable = unknown.empty();
            int values = static_cast<int>(std::count_if(plan->value_bytes.begin(), plan->value_bytes.end(),
                                                        [](int8_t bytes) { return bytes > 0; }));
            trace(plan->replayable ? "launches replay (" + std::to_string(values) + " pass-by-value scalars)"
                                   : "launches do not replay: " + unknown);
        }
#endif
        slot = std::move(graph);
    }
    *out = slot.get();
    *workspace = plan->workspace[ordinal];
    if (indexed(ordinal) && plan->ready[ordinal].load(std::memory_order_relaxed) == nullptr) {  // once
        plan->ready_workspace[ordinal] = *workspace;
        plan->ready[ordinal].store(*out, std::memory_order_release);
    }
    return "";
}

// Deserializes `plan` on `ordinal` now; its workspace bytes, or -1 with the reason in *error.
inline int64_t prepare(Plan *plan, int32_t ordinal, std::string *error) {
    Device *device = nullptr;
    fe::graph::Graph *graph = nullptr;
    int64_t workspace = 0;
    *error = Registry::get().device(ordinal, &device);
    if (error->empty()) *error = graph_on(plan, ordinal, device, &graph, &workspace);
    return error->empty() ? workspace : -1;
}

// The CUDA runtime's graph entry points (replay.h), found once in the runtime the process loaded.
inline const GraphApi &graph_api() {
    static const GraphApi api = [] {
        GraphApi found;
        try {
            auto find = [](const char *name) {
                return fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, name);
            };
            found.is_capturing = reinterpret_cast<decltype(found.is_capturing)>(find("cudaStreamIsCapturing"));
            found.create_stream = reinterpret_cast<decltype(found.create_stream)>(find("cudaStreamCreateWithFlags"));
            found.begin_capture = reinterpret_cast<decltype(found.begin_capture)>(find("cudaStreamBeginCapture"));
            found.end_capture = reinterpret_cast<decltype(found.end_capture)>(find("cudaStreamEndCapture"));
            found.instantiate = reinterpret_cast<decltype(found.instantiate)>(find("cudaGraphInstantiateWithFlags"));
            found.launch = reinterpret_cast<decltype(found.launch)>(find("cudaGraphLaunch"));
            found.destroy_exec = reinterpret_cast<decltype(found.destroy_exec)>(find("cudaGraphExecDestroy"));
            found.destroy_graph = reinterpret_cast<decltype(found.destroy_graph)>(find("cudaGraphDestroy"));
            found.last_error = reinterpret_cast<decltype(found.last_error)>(find("cudaGetLastError"));
            found.synchronize = reinterpret_cast<decltype(found.synchronize)>(find("cudaDeviceSynchronize"));
            found.ok = true;
        } catch (const std::exception &error) {
            trace(std::string("no replays: ") + error.what());
        }
        return found;
    }();
    return api;
}

// Launches by route, for tests and benchmarks (fusedattn_core_replay_counts).
struct ReplayCounts {
    std::atomic<int64_t> executed{0};  // through cuDNN's execute
    std::atomic<int64_t> captured{0};  // captured into a graph (then replayed)
    std::atomic<int64_t> replayed{0};  // from a graph captured before
    std::atomic<int64_t> failed{0};    // captures that failed (their plan executes from then on)
};

inline ReplayCounts &replay_counts() {
    static ReplayCounts counts;
    return counts;
}

#if CUDNN_FRONTEND_VERSION >= 13200
// A plan's replays on one device: its graph deserialized again without CUDA-graph retention, and the
// launches captured from that copy. A retained graph's launches each hold a CUDA user object, and
// the driver makes the host wait once about 30 of those are queued (measured on an H100: held-GPU
// loops of 32 launches waited for the GPU, 24 did not; without retention 128 did not). So the plan
// keeps this copy alive itself: the launches go first (declared last), and ~Plan lets the device
// finish what is queued before either goes. Launches that a caller's own capture records use the
// plan's retained graph, as before.
struct PlanReplays {
    explicit PlanReplays(const GraphApi *api) : launches(api) {}
    std::unique_ptr<fe::graph::Graph> graph;
    Replays launches;
    bool may_run() const { return graph != nullptr; }  // the copy's work may still be queued
};
#else
struct PlanReplays {
    Replays launches{nullptr};
    bool may_run() const { return false; }
};
#endif

Plan::~Plan() {
    for (int32_t ordinal = 0; ordinal < kMaxDevices; ++ordinal) {
        if (!replays[ordinal] || !replays[ordinal]->may_run()) continue;
        const GraphApi &api = graph_api();
        std::string error = on_device(ordinal, [&]() -> std::string {
            return api.synchronize() == cudaSuccess ? "" : "cudaDeviceSynchronize failed";
        });
        if (!error.empty()) {  // (inside a capture, say): leak them rather than free code a launch may run
            api.last_error();
            replays[ordinal].release();
        }
    }
}

#if CUDNN_FRONTEND_VERSION >= 13200
// Captures one execute of `graph` into an executable CUDA graph on the device's capture stream;
// nullptr when anything fails (the capture is ended and the runtime's error cleared either way).
inline cudaGraphExec_t capture_launch(int32_t ordinal, Device *device, fe::graph::Graph *graph, void **sorted,
                                      int reads, void *workspace) {
    const GraphApi &api = graph_api();
    if (device->capture == nullptr) {
        std::string error = on_device(ordinal, [&]() -> std::string {
            return api.create_stream(&device->capture, cudaStreamNonBlocking) == cudaSuccess ? "" : "failed";
        });
        if (!error.empty()) {
            device->capture = nullptr;
            api.last_error();
            return nullptr;
        }
    }
    if (fe::detail::set_stream(device->handle, device->capture) != CUDNN_STATUS_SUCCESS) return nullptr;
    if (api.begin_capture(device->capture, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        api.last_error();
        return nullptr;
    }
    bool executed = false;
    try {
        executed = graph->execute(device->handle, sorted, reads, workspace).is_good();
    } catch (const std::exception &) {
    }
    cudaGraph_t captured = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (api.end_capture(device->capture, &captured) == cudaSuccess && executed && captured != nullptr &&
        api.instantiate(&exec, captured, 0) != cudaSuccess) {
        exec = nullptr;
    }
    if (captured != nullptr) api.destroy_graph(captured);
    if (exec == nullptr) api.last_error();
    return exec;
}

// The plan's graph on `ordinal` deserialized again, retaining nothing in CUDA graphs (PlanReplays).
inline std::unique_ptr<fe::graph::Graph> unretained_graph(const Plan *plan, int32_t ordinal, Device *device) {
    auto graph = std::make_unique<fe::graph::Graph>();
    graph->set_cuda_graph_retention(fe::CudaGraphRetention_t::NONE);
    std::string error = on_device(ordinal, [&]() -> std::string {
        auto status = graph->deserialize(device->handle, plan->blob, false, /*run_warmup=*/false);
        return status.is_good() ? "" : status.get_message();
    });
    if (!error.empty()) trace("no replays: deserializing an unretained copy: " + error);
    return error.empty() ? std::move(graph) : nullptr;
}

// Launches `plan` on `stream` from a CUDA graph of an earlier launch with the same key, capturing the
// launch on its key's second sighting (replay.h). True when it launched (the outcome in *error);
// false when the caller executes the plan instead. Called under the device's launch lock.
inline bool replay(Plan *plan, int32_t ordinal, Device *device, cudaStream_t stream, void **sorted, int reads,
                   void *workspace, std::string *error) {
    const GraphApi &api = graph_api();
    if (!plan->replayable || !indexed(ordinal) || !replay_enabled() || !api.ok) return false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (api.is_capturing(stream, &status) != cudaSuccess) {
        api.last_error();
        return false;
    }
    if (status != cudaStreamCaptureStatusNone) return false;  // the caller's own capture records the launch
    auto &replays = plan->replays[ordinal];
    if (!replays) replays = std::make_unique<PlanReplays>(&api);
    static thread_local std::string key;
    replay_key(sorted, plan->value_bytes, workspace, &key);
    bool capture = false;
    cudaGraphExec_t exec = replays->launches.find(key, &capture);
    if (exec == nullptr && capture && !replays->graph) {
        // The copy's first launch runs as a plain execute (its kernels load outside any capture); the
        // key's next sighting captures.
        replays->graph = unretained_graph(plan, ordinal, device);
        if (!replays->graph) {
            replays->launches.off = true;
            return false;
        }
        replays->launches.sighted(key);
        if (fe::detail::set_stream(device->handle, stream) != CUDNN_STATUS_SUCCESS) {
            *error = "cudnnSetStream failed";
            return true;
        }
        replay_counts().executed++;
        auto executed = replays->graph->execute(device->handle, sorted, reads, workspace);
        *error = executed.is_good() ? "" : "cuDNN execute: " + executed.get_message();
        return true;
    }
    if (exec == nullptr && capture) {
        exec = capture_launch(ordinal, device, replays->graph.get(), sorted, reads, workspace);
        if (exec == nullptr) {
            replays->launches.off = true;
            replay_counts().failed++;
            trace("a capture failed: this plan executes from now on");
            return false;
        }
        replays->launches.keep(key, exec);
        replay_counts().captured++;
    } else if (exec != nullptr) {
        replay_counts().replayed++;
    }
    if (exec == nullptr) return false;
    cudaError_t launched = api.launch(exec, stream);
    *error = launched == cudaSuccess ? "" : "cudaGraphLaunch failed with error " + std::to_string(launched);
    if (launched != cudaSuccess) api.last_error();
    return true;
}
#endif

// Executes `plan` on `ordinal` and `stream` with `count` pointers, one per slot (slots the plan
// leaves unbound are skipped; pass-by-value scalars are host pointers) and a workspace of at least
// the plan's size on that device. "" on success.
inline std::string execute(Plan *plan, int32_t ordinal, cudaStream_t stream, void *const *slots, int64_t count,
                           void *workspace, int64_t workspace_bytes) {
    if (count < 0 || count > static_cast<int64_t>(plan->uids.size())) {
        return "the call passes " + std::to_string(count) + " buffers, the plan binds " +
               std::to_string(plan->uids.size());
    }
    Device *device = nullptr;
    fe::graph::Graph *graph = nullptr;
    int64_t needed = 0;
    Stopwatch watch;
    std::string error = Registry::get().device(ordinal, &device);
    if (error.empty()) error = graph_on(plan, ordinal, device, &graph, &needed);
    if (!error.empty()) return error;
    watch.lap(kLookups);
    if (needed > workspace_bytes) {
        return "the graph needs a " + std::to_string(needed) + "-byte workspace on device " + std::to_string(ordinal) +
               ", the call has " + std::to_string(workspace_bytes);
    }
#if CUDNN_FRONTEND_VERSION >= 13200
    // The graph's pointers in the frontend's sorted order, straight from the slots.
    constexpr size_t kOnStack = 64;
    void *on_stack[kOnStack];
    std::vector<void *> on_heap;
    const size_t reads = plan->order.size();
    void **sorted = reads <= kOnStack ? on_stack : (on_heap.resize(reads), on_heap.data());
    for (size_t j = 0; j < reads; ++j) {
        int32_t slot = plan->order[j];
        if (slot < 0 || slot >= count) {
            return "the graph reads uid " + std::to_string(plan->order_uids[j]) + ", which the call does not bind";
        }
        sorted[j] = slots[slot];
    }
    watch.lap(kBinding);
    std::lock_guard<std::mutex> lock(device->mutex);
    std::string replayed;
    if (replay(plan, ordinal, device, stream, sorted, static_cast<int>(reads), workspace, &replayed)) {
        watch.lap(kExecute);
        return replayed;
    }
    if (fe::detail::set_stream(device->handle, stream) != CUDNN_STATUS_SUCCESS) return "cudnnSetStream failed";
    watch.lap(kStream);
    replay_counts().executed++;
    auto status = graph->execute(device->handle, sorted, static_cast<int>(reads), workspace);
#else
    // This thread's map from the last launch: clear() keeps its buckets, so only the entries are new.
    static thread_local std::unordered_map<int64_t, void *> pointers;
    pointers.clear();
    for (int64_t i = 0; i < count; ++i) {
        int64_t uid = plan->uids[i];
        if (uid >= 0) pointers.emplace(uid, slots[i]);
    }
    watch.lap(kBinding);
    std::lock_guard<std::mutex> lock(device->mutex);
    if (fe::detail::set_stream(device->handle, stream) != CUDNN_STATUS_SUCCESS) return "cudnnSetStream failed";
    watch.lap(kStream);
    auto status = graph->execute(device->handle, pointers, workspace);
#endif
    watch.lap(kExecute);
    if (status.is_bad()) return "cuDNN execute: " + status.get_message();
    return "";
}

inline std::shared_ptr<Plan> make_plan(const uint8_t *blob, int64_t size, const int64_t *uids, int64_t count) {
    auto plan = std::make_shared<Plan>();
    plan->blob.assign(blob, blob + size);
    for (int64_t i = 0; i < count; ++i) {  // stated slots come as uid + kBufferSlot or kValueSlot * bytes
        int64_t uid = uids[i];
        if (uid >= kBufferSlot) {
            plan->uids.push_back(uid - kBufferSlot);
            plan->slot_values.push_back(0);
        } else if (uid >= kValueSlot) {
            plan->uids.push_back(uid % kValueSlot);
            plan->slot_values.push_back(static_cast<int8_t>(uid / kValueSlot));
        } else {
            plan->uids.push_back(uid);
            plan->slot_values.push_back(-1);
        }
    }
    return plan;
}

}  // namespace fusedattn_native

// The C interface: plans by id, errors as text (this thread's last one).
#pragma GCC visibility push(default)

extern "C" {

static thread_local std::string core_error;

const char *fusedattn_core_last_error() { return core_error.c_str(); }

// Loads cuDNN for the frontend from `path` (the library the process already uses). 0 on success.
int fusedattn_core_init(const char *path) {
    core_error = fusedattn_native::Registry::get().init(path);
    return core_error.empty() ? 0 : 1;
}

// Registers a serialized graph and the uid of each slot under their digest (a non-negative number
// that names the content: registering it again, from either framework, finds the same plan); the
// plan's id, which is the digest.
int64_t fusedattn_core_register(const uint8_t *blob, int64_t size, const int64_t *uids, int64_t count,
                                int64_t digest) {
    if (digest < 0) {
        core_error = "a plan's digest is a non-negative number, got " + std::to_string(digest);
        return -1;
    }
    return fusedattn_native::Registry::get().plans.add(digest, fusedattn_native::make_plan(blob, size, uids, count));
}

// Deserializes a plan on `device` now: its workspace bytes, or -1 with the reason in the last error.
int64_t fusedattn_core_prepare(int64_t plan_id, int32_t device) {
    auto plan = fusedattn_native::Registry::get().plans.find(plan_id);
    if (plan == nullptr) {
        core_error = "native plan " + std::to_string(plan_id) + " is not registered in this process";
        return -1;
    }
    try {
        return fusedattn_native::prepare(plan.get(), device, &core_error);
    } catch (const std::exception &error) {  // the frontend's loader throws when a library is missing
        core_error = error.what();
        return -1;
    }
}

// Executes a plan with one pointer per slot on `stream`. 0 on success; kNotRegistered when the plan is
// not held (never registered here, or evicted: register it again), else -1; the reason in the last error.
int fusedattn_core_execute(int64_t plan_id, int32_t device, void *stream, void *const *slots, int64_t count,
                           void *workspace, int64_t workspace_bytes) {
    auto plan = fusedattn_native::Registry::get().plans.find(plan_id);
    if (plan == nullptr) {
        core_error = "native plan " + std::to_string(plan_id) + " is not registered in this process";
        return fusedattn_native::kNotRegistered;
    }
    try {
        core_error = fusedattn_native::execute(plan.get(), device, static_cast<cudaStream_t>(stream), slots, count,
                                               workspace, workspace_bytes);
    } catch (const std::exception &error) {
        core_error = error.what();
    }
    return core_error.empty() ? 0 : -1;
}

// Launches so far by route: executed through cuDNN, captured, replayed, failed captures (four numbers).
void fusedattn_core_replay_counts(int64_t *counts) {
    auto &all = fusedattn_native::replay_counts();
    counts[0] = all.executed.load();
    counts[1] = all.captured.load();
    counts[2] = all.replayed.load();
    counts[3] = all.failed.load();
}

// Sets the registry's bound (when capacity > 0); the number of plans it holds.
int64_t fusedattn_core_bounds(int64_t capacity) {
    if (capacity > 0) fusedattn_native::Registry::get().plans.set_capacity(capacity);
    return fusedattn_native::Registry::get().plans.size();
}

}  // extern "C"

#pragma GCC visibility pop
