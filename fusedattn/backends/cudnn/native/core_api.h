// The launch core's C interface (launch_core.cc) as its callers see it: the torch operator and the
// XLA FFI handler each find the core's functions in the library Python loaded, by path. No cuDNN,
// torch or XLA here, so every library can include it.

#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <string>

namespace fusedattn_native {

constexpr int64_t kUnbound = -1;    // a slot the graph does not read or write
constexpr int64_t kWorkspace = -2;  // the slot that serves as cuDNN's workspace (JAX: a result buffer)
constexpr int kNotRegistered = -2;  // fusedattn_core_execute's status for a plan it does not hold
// A slot that passes a pass-by-value scalar (a host pointer to its bytes) registers its uid plus
// kValueSlot times those bytes, so a replayed launch (replay.h) is keyed by the scalar's value, not by
// where the caller keeps it this time.
constexpr int64_t kValueSlot = int64_t(1) << 40;
// A slot its caller states is a device buffer registers its uid plus kBufferSlot. A plan replays only
// when every slot it reads is known as one or the other (stated so, or listed by its serialized graph).
constexpr int64_t kBufferSlot = int64_t(1) << 44;

struct CoreApi {
    const char *(*last_error)() = nullptr;
    int64_t (*register_plan)(const uint8_t *, int64_t, const int64_t *, int64_t, int64_t) = nullptr;
    int64_t (*prepare)(int64_t, int32_t) = nullptr;
    int (*execute)(int64_t, int32_t, void *, void *const *, int64_t, void *, int64_t) = nullptr;
};

// Fills `api` from the core library at `path` (already loaded by Python); "" on success.
inline std::string load_core(const char *path, CoreApi *api) {
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
        const char *reason = dlerror();
        return std::string("dlopen ") + path + ": " + (reason ? reason : "unknown error");
    }
    CoreApi found;
    found.last_error = reinterpret_cast<decltype(found.last_error)>(dlsym(library, "fusedattn_core_last_error"));
    found.register_plan = reinterpret_cast<decltype(found.register_plan)>(dlsym(library, "fusedattn_core_register"));
    found.prepare = reinterpret_cast<decltype(found.prepare)>(dlsym(library, "fusedattn_core_prepare"));
    found.execute = reinterpret_cast<decltype(found.execute)>(dlsym(library, "fusedattn_core_execute"));
    if (!found.last_error || !found.register_plan || !found.prepare || !found.execute) {
        return std::string("the launch core at ") + path + " lacks its functions";
    }
    *api = found;
    return "";
}

}  // namespace fusedattn_native
