// fusedattn's cuDNN graphs as an XLA FFI custom call.
//
// Python builds a graph (fusedattn/backends/cudnn), serializes it and registers the bytes
// here with the uid each of the call's buffers binds to. XLA then runs the call like any
// custom call: no Python, no GIL, no torch on the hot path. Each device deserializes the
// graph on its first call and keeps it; the workspace is one more result buffer, sized when
// the call was traced (XLA's scratch allocator refused FFI calls on the GPU: measured).

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn_frontend.h>

#include "xla/ffi/api/ffi.h"

namespace cudnn_frontend {
// The frontend's dynamic-loading shim calls cuDNN through this handle; fusedattn_init sets it to
// the libcudnn the Python process already loaded, so both sides share one cuDNN.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace {

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

constexpr int64_t kUnbound = -1;    // a buffer the graph does not read or write
constexpr int64_t kWorkspace = -2;  // the result buffer that serves as cuDNN's workspace

struct Plan {
    int64_t digest = 0;  // of the bytes and uids: a program compiled in another process names another graph
    std::vector<uint8_t> blob;
    std::vector<int64_t> uids;  // one per buffer (operands, then results), or kUnbound / kWorkspace
    std::mutex mutex;           // guards graphs
    std::unordered_map<int32_t, std::unique_ptr<fe::graph::Graph>> graphs;  // by device
};

struct Device {
    cudnnHandle_t handle = nullptr;
    std::mutex mutex;  // a cuDNN handle serves one launch at a time
};

std::mutex registry_mutex;
std::vector<std::unique_ptr<Plan>> plans;  // id = index; never shrinks, so Plan* stay valid
std::unordered_map<int32_t, std::unique_ptr<Device>> devices;
thread_local std::string last_error;

Plan *find_plan(int64_t id) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    return (id >= 0 && id < static_cast<int64_t>(plans.size())) ? plans[id].get() : nullptr;
}

// FUSEDATTN_NATIVE_DEBUG=1: each step on stderr (what a crash report lacks).
void trace(const std::string &step) {
    static const bool on = [] {
        const char *value = std::getenv("FUSEDATTN_NATIVE_DEBUG");
        return value != nullptr && value[0] == '1';
    }();
    if (on) std::fprintf(stderr, "fusedattn native: %s\n", step.c_str());
}

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

std::string get_device(int32_t ordinal, Device **out) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto &slot = devices[ordinal];
    if (!slot) {
        auto device = std::make_unique<Device>();
        trace("creating a cuDNN handle on device " + std::to_string(ordinal));
        std::string error = on_device(ordinal, [&]() -> std::string {
            cudnnStatus_t status = fe::detail::create_handle(&device->handle);
            return status == CUDNN_STATUS_SUCCESS ? "" : "cudnnCreate failed with status " + std::to_string(status);
        });
        if (!error.empty()) return error;
        slot = std::move(device);
    }
    *out = slot.get();
    return "";
}

// The plan's graph on `ordinal`, deserialized on first use there.
std::string get_graph(Plan *plan, int32_t ordinal, Device *device, fe::graph::Graph **out) {
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
        trace("deserialized; workspace " + std::to_string(graph->get_workspace_size()) + " bytes");
        slot = std::move(graph);
    }
    *out = slot.get();
    return "";
}

ffi::Error Execute(cudaStream_t stream, int32_t ordinal, int64_t plan_id, int64_t digest, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
    Plan *plan = find_plan(plan_id);
    if (plan == nullptr || plan->digest != digest) {
        return ffi::Error::InvalidArgument(
            "fusedattn: this program names cuDNN plan " + std::to_string(plan_id) +
            ", which this process did not register for it (a program compiled in another process, e.g. through "
            "jax.export or a serialized executable); trace the call in this process, or set FUSEDATTN_JAX_NATIVE=0");
    }
    if (args.size() + rets.size() != plan->uids.size()) {
        return ffi::Error::InvalidArgument("fusedattn: plan " + std::to_string(plan_id) + " binds " +
                                           std::to_string(plan->uids.size()) + " buffers, the call has " +
                                           std::to_string(args.size() + rets.size()));
    }
    Device *device = nullptr;
    fe::graph::Graph *graph = nullptr;
    std::string error = get_device(ordinal, &device);
    if (error.empty()) error = get_graph(plan, ordinal, device, &graph);
    if (!error.empty()) return ffi::Error::Internal("fusedattn: " + error);

    std::unordered_map<int64_t, void *> pointers;
    for (size_t i = 0; i < args.size(); ++i) {
        if (plan->uids[i] == kUnbound) continue;
        auto buffer = args.get<ffi::AnyBuffer>(i);
        if (buffer.has_error()) return buffer.error();
        pointers.emplace(plan->uids[i], buffer->untyped_data());
    }
    void *workspace = nullptr;
    size_t workspace_bytes = 0;
    for (size_t i = 0; i < rets.size(); ++i) {
        int64_t uid = plan->uids[args.size() + i];
        if (uid == kUnbound) continue;
        auto buffer = rets.get<ffi::AnyBuffer>(i);
        if (buffer.has_error()) return buffer.error();
        if (uid == kWorkspace) {
            workspace = (*buffer)->untyped_data();
            workspace_bytes = (*buffer)->size_bytes();
        } else {
            pointers.emplace(uid, (*buffer)->untyped_data());
        }
    }
    int64_t needed = graph->get_workspace_size();
    if (needed > static_cast<int64_t>(workspace_bytes)) {
        return ffi::Error::Internal("fusedattn: the graph needs a " + std::to_string(needed) +
                                    "-byte workspace on device " + std::to_string(ordinal) + ", the call has " +
                                    std::to_string(workspace_bytes));
    }
    std::lock_guard<std::mutex> lock(device->mutex);
    if (fe::detail::set_stream(device->handle, stream) != CUDNN_STATUS_SUCCESS) {
        return ffi::Error::Internal("fusedattn: cudnnSetStream failed");
    }
    auto status = graph->execute(device->handle, pointers, workspace);
    if (status.is_bad()) return ffi::Error::Internal("fusedattn: cuDNN execute: " + status.get_message());
    return ffi::Error::Success();
}

}  // namespace

// Built with hidden visibility (so the frontend's inline code never binds to another copy in the
// process, such as torch's); these are the library's only exports.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedattn_cudnn_execute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("plan")
                                  .Attr<int64_t>("digest")
                                  .RemainingArgs()
                                  .RemainingRets());

extern "C" {

// Loads cuDNN for the frontend from `path` (the library the process already uses). 0 on success.
int fusedattn_init(const char *path) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    trace(std::string("loading ") + path);
    if (fe::cudnn_dlhandle != nullptr) return 0;
    fe::cudnn_dlhandle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle == nullptr) {
        const char *reason = dlerror();
        last_error = std::string("dlopen ") + path + ": " + (reason ? reason : "unknown error");
        return 1;
    }
    return 0;
}

// Registers a serialized graph, the uid of each buffer of its calls and their digest; the plan's id.
int64_t fusedattn_register(const uint8_t *blob, int64_t size, const int64_t *uids, int64_t count, int64_t digest) {
    auto plan = std::make_unique<Plan>();
    plan->digest = digest;
    plan->blob.assign(blob, blob + size);
    plan->uids.assign(uids, uids + count);
    std::lock_guard<std::mutex> lock(registry_mutex);
    plans.push_back(std::move(plan));
    return static_cast<int64_t>(plans.size()) - 1;
}

// Deserializes a plan on `device` now (so a failure shows when the call is traced, not run).
// Its workspace size, or -1 with the reason in fusedattn_last_error().
int64_t fusedattn_prepare(int64_t plan_id, int32_t device) {
    Plan *plan = find_plan(plan_id);
    if (plan == nullptr) {
        last_error = "unknown plan " + std::to_string(plan_id);
        return -1;
    }
    Device *handle_owner = nullptr;
    fe::graph::Graph *graph = nullptr;
    std::string error = get_device(device, &handle_owner);
    if (error.empty()) error = get_graph(plan, device, handle_owner, &graph);
    if (!error.empty()) {
        last_error = error;
        return -1;
    }
    return graph->get_workspace_size();
}

const char *fusedattn_last_error() { return last_error.c_str(); }

}  // extern "C"

#pragma GCC visibility pop
