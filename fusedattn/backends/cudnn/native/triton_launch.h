// Launching Triton-compiled kernels from C++: the cubins Python compiled (sequence_plans.py), loaded
// into each device's primary context on first use and launched through the CUDA driver, which is
// found at run time (no CUDA headers or libraries at build time, as Triton's own launcher does).
//
// A kernel's arguments are one 8-byte word each, in the kernel's order (constexprs left out):
// pointers and int64 as they are, a float32 in the word's first 4 bytes. Python compiles every int
// argument as int64 and every pointer without an alignment assumption, so any tensor and any size
// fit the one compiled kernel. Triton appends two scratch pointers; ours need no scratch (checked
// when compiled), so both are null.
#pragma once

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace fusedattn_native {

class TritonKernel {
   public:
    static constexpr int kMaxDevices = 64;

    TritonKernel(std::string image, std::string name, int warps, int shared)
        : image_(std::move(image)), name_(std::move(name)), warps_(warps), shared_(shared) {
        for (auto &function : functions_) function.store(nullptr, std::memory_order_relaxed);
        for (auto &context : contexts_) context.store(nullptr, std::memory_order_relaxed);
    }

    // Whether `stream` (a CUstream) is being captured into a CUDA graph; true where the driver cannot say.
    static bool capturing(void *stream) {
        Driver &cu = driver();
        int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
        return !cu.error.empty() || cu.is_capturing(stream, &status) != 0 || status != 0;
    }

    // Loads the kernel on `device` now rather than at its first launch (which may be under capture); ""
    // on success, else why not.
    std::string prepare(int device) {
        if (device < 0 || device >= kMaxDevices) return "device index out of range";
        if (!driver().error.empty()) return driver().error;
        void *function = nullptr;
        return load(device, &function);
    }

    // Launches `blocks` programs on `stream` (a CUstream) of `device`; "" on success, else why not.
    std::string launch(int device, void *stream, int64_t blocks, std::vector<uint64_t> &words) {
        if (blocks <= 0) return "";
        if (device < 0 || device >= kMaxDevices) return "device index out of range";
        Driver &cu = driver();
        if (!cu.error.empty()) return cu.error;
        void *function = functions_[device].load(std::memory_order_acquire);
        if (function == nullptr) {
            std::string error = load(device, &function);
            if (!error.empty()) return error;
        }
        std::vector<void *> params(words.size() + 2);
        for (size_t i = 0; i < words.size(); ++i) params[i] = &words[i];
        uint64_t scratch[2] = {0, 0};  // global and profile scratch: none
        params[words.size()] = &scratch[0];
        params[words.size() + 1] = &scratch[1];
        // The function lives in the device's primary context, which torch's thread has current; a
        // thread with another context current gets the primary one for the launch.
        void *current = nullptr;
        cu.ctx_get_current(&current);
        void *context = contexts_[device].load(std::memory_order_acquire);
        bool switched = current != context;
        if (switched && cu.ctx_push(context) != 0) return "cuCtxPushCurrent failed";
        int status = cu.launch(function, static_cast<unsigned>(blocks), 1, 1, 32 * warps_, 1, 1, shared_, stream,
                               params.data(), nullptr);
        if (switched) {
            void *popped = nullptr;
            cu.ctx_pop(&popped);
        }
        return status == 0 ? "" : "cuLaunchKernel(" + name_ + ") failed: " + cu.describe(status);
    }

   private:
    struct Driver {
        using Result = int;
        Result (*device_get)(int *, int) = nullptr;
        Result (*primary_retain)(void **, int) = nullptr;
        Result (*ctx_push)(void *) = nullptr;
        Result (*ctx_pop)(void **) = nullptr;
        Result (*ctx_get_current)(void **) = nullptr;
        Result (*module_load)(void **, const void *) = nullptr;
        Result (*module_function)(void **, void *, const char *) = nullptr;
        Result (*function_attribute)(void *, int, int) = nullptr;
        Result (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **) = nullptr;
        Result (*error_string)(Result, const char **) = nullptr;
        Result (*is_capturing)(void *, int *) = nullptr;
        std::string error;

        Driver() {
            void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
            if (library == nullptr) {
                error = "libcuda.so.1 could not be loaded";
                return;
            }
            auto find = [&](auto &slot, const char *name) {
                slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(library, name));
                if (slot == nullptr && error.empty()) error = std::string("the CUDA driver has no ") + name;
            };
            find(device_get, "cuDeviceGet");
            find(primary_retain, "cuDevicePrimaryCtxRetain");
            find(ctx_push, "cuCtxPushCurrent_v2");
            find(ctx_pop, "cuCtxPopCurrent_v2");
            find(ctx_get_current, "cuCtxGetCurrent");
            find(module_load, "cuModuleLoadData");
            find(module_function, "cuModuleGetFunction");
            find(function_attribute, "cuFuncSetAttribute");
            find(launch, "cuLaunchKernel");
            find(error_string, "cuGetErrorString");
            find(is_capturing, "cuStreamIsCapturing");
        }

        std::string describe(Result status) const {
            const char *text = nullptr;
            if (error_string != nullptr) error_string(status, &text);
            return text != nullptr ? text : "CUDA error " + std::to_string(status);
        }
    };

    static Driver &driver() {
        static Driver instance;
        return instance;
    }

    // Loads the cubin into `device`'s primary context once.
    std::string load(int device, void **function) {
        std::lock_guard<std::mutex> lock(mutex_);
        *function = functions_[device].load(std::memory_order_acquire);
        if (*function != nullptr) return "";
        Driver &cu = driver();
        int handle = 0;
        void *context = nullptr, *module = nullptr, *popped = nullptr;
        int status = cu.device_get(&handle, device);
        if (status == 0) status = cu.primary_retain(&context, handle);
        if (status != 0) return "no primary context on device " + std::to_string(device) + ": " + cu.describe(status);
        if (cu.ctx_push(context) != 0) return "cuCtxPushCurrent failed";
        status = cu.module_load(&module, image_.data());
        if (status == 0) status = cu.module_function(function, module, name_.c_str());
        constexpr int kMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (status == 0 && shared_ > 48 * 1024) status = cu.function_attribute(*function, kMaxDynamicSharedBytes, shared_);
        cu.ctx_pop(&popped);
        if (status != 0) return "loading kernel " + name_ + " failed: " + cu.describe(status);
        contexts_[device].store(context, std::memory_order_release);
        functions_[device].store(*function, std::memory_order_release);
        return "";
    }

    std::string image_, name_;
    int warps_, shared_;
    std::mutex mutex_;
    std::array<std::atomic<void *>, kMaxDevices> functions_;
    std::array<std::atomic<void *>, kMaxDevices> contexts_;
};

}  // namespace fusedattn_native
