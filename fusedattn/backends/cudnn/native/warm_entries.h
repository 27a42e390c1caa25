// Repeat calls of fusedattn.torch.attention answered in C: the warm entries.
//
// After Python has answered a call from its plan cache (and, for a score_mod, its kept binding), it
// hands the answer here under a key made of the call itself: q, k, v (shapes, strides, dtypes,
// devices, requires_grad), every keyword with its type and value (a callback by its code, globals and
// closure contents; other objects by identity, the entry holding them; bias and sink tensors as q, k, v
// are), the grad mode and fusedattn's environment settings. The answer
// is the operator's plan and operands, with guards: what the callbacks read (their cells and globals,
// objects by identity, numbers by exact value), dicts they read item by item, and the tensors they
// hold (version, requires_grad). A later call with the same key whose guards hold goes straight to
// the operator; any other call misses and takes the Python path, which may hand a new answer.
// Python calls this only for eager calls (never while torch.compile traces nor while explain runs).
// Needs the GIL throughout (entries hold Python objects).

#pragma once

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>

namespace fusedattn_warm {

// A strong reference, dropped with its holder (always under the GIL: entries live in a map only
// Python calls touch, and that map is never destroyed at exit).
class Held {
   public:
    Held() = default;
    explicit Held(PyObject *object) : object_(object) { Py_XINCREF(object_); }
    Held(const Held &other) : Held(other.object_) {}
    Held &operator=(const Held &) = delete;
    ~Held() { Py_XDECREF(object_); }
    PyObject *get() const { return object_; }

   private:
    PyObject *object_ = nullptr;
};

// Whether `now` is the read `was` was: the same object, or an int or float of the same type and value
// (floats by their bits: -0.0 is not 0.0), as the bindings' keys compare them.
inline bool same_read(PyObject *was, PyObject *now) {
    if (was == now) return true;
    if (was == nullptr || now == nullptr || Py_TYPE(was) != Py_TYPE(now)) return false;
    if (PyFloat_CheckExact(was)) {
        double a = PyFloat_AS_DOUBLE(was), b = PyFloat_AS_DOUBLE(now);
        return std::memcmp(&a, &b, sizeof a) == 0;
    }
    if (PyLong_CheckExact(was)) {
        int overflow_a = 0, overflow_b = 0;
        long long a = PyLong_AsLongLongAndOverflow(was, &overflow_a);
        long long b = PyLong_AsLongLongAndOverflow(now, &overflow_b);
        return overflow_a == 0 && overflow_b == 0 && a == b;
    }
    return false;
}

// What one callback reads: its code, no defaults, its cells' contents and the globals its names read
// (a missing global reads as None, as Python's fn.__globals__.get gives it).
struct FunctionGuard {
    Held function, code;
    std::vector<Held> cells;
    std::vector<Held> names, globals;

    bool holds() const {
        PyObject *fn = function.get();
        if (PyFunction_GET_CODE(fn) != code.get() || PyFunction_GET_DEFAULTS(fn) != nullptr ||
            PyFunction_GET_KW_DEFAULTS(fn) != nullptr) {
            return false;
        }
        PyObject *closure = PyFunction_GET_CLOSURE(fn);
        Py_ssize_t count = closure == nullptr ? 0 : PyTuple_GET_SIZE(closure);
        if (count != static_cast<Py_ssize_t>(cells.size())) return false;
        for (Py_ssize_t i = 0; i < count; ++i) {
            if (!same_read(cells[i].get(), PyCell_GET(PyTuple_GET_ITEM(closure, i)))) return false;
        }
        PyObject *scope = PyFunction_GET_GLOBALS(fn);
        for (size_t i = 0; i < names.size(); ++i) {
            PyObject *now = PyDict_GetItemWithError(scope, names[i].get());  // borrowed
            if (now == nullptr) {
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    return false;
                }
                now = Py_None;
            }
            if (!same_read(globals[i].get(), now)) return false;
        }
        return true;
    }
};

// A dict read whole: the same keys in the same order, each with the same value.
struct DictGuard {
    Held dict;
    std::vector<Held> keys, values;

    bool holds() const {
        if (PyDict_GET_SIZE(dict.get()) != static_cast<Py_ssize_t>(keys.size())) return false;
        Py_ssize_t position = 0;
        PyObject *key = nullptr, *value = nullptr;
        for (size_t i = 0; PyDict_Next(dict.get(), &position, &key, &value); ++i) {
            if (!same_read(keys[i].get(), key) || !same_read(values[i].get(), value)) return false;
        }
        return true;
    }
};

// A tensor a score_mod holds: unchanged in place, learning (or not) as when bound.
struct TensorGuard {
    at::Tensor tensor;
    int64_t version;
    bool requires_grad;

    bool holds() const { return tensor._version() == version && tensor.requires_grad() == requires_grad; }
};

// Appends the words naming a tensor's shape, strides, dtype, device and requires_grad to `out` (as int64
// bytes); false where it is no dense strided tensor with concrete sizes. Both keys read it: tensor_key
// (the plan-cache signature's tensor part) and a warm entry's.
inline bool append_tensor_words(const at::Tensor &x, std::string &out) {
    if (x.layout() != c10::kStrided || x.is_nested() || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
        return false;
    }
    auto word = [&out](int64_t w) { out.append(reinterpret_cast<const char *>(&w), sizeof w); };
    word(x.dim());
    for (int64_t size : x.sizes()) word(size);
    for (int64_t stride : x.strides()) word(stride);
    word(static_cast<int64_t>(x.scalar_type()));
    word(static_cast<int64_t>(x.device().type()));
    word(x.device().index());
    word(x.requires_grad());
    return true;
}

// What a hit runs, and what must still hold for it to be right.
struct Entry {
    int64_t plan = -1;
    std::vector<at::Tensor> aux;
    std::vector<double> scalars;
    bool empty_rows = false;
    bool lse = false, max_logit = false;  // returned beside the output (an AttentionResult, made by Python)
    bool dropout = false;  // a seed drawn per call from torch's default generator, as Python's path draws it
    std::vector<at::Tensor> offsets;  // a THD plan's sequence offsets (a document mask's, kept per ids' version)
    std::vector<Held> identities;  // the key's objects by identity: alive, so their addresses name them
    std::vector<FunctionGuard> functions;
    std::vector<DictGuard> dicts;
    std::vector<TensorGuard> tensors;

    bool holds() const {
        for (const auto &guard : tensors) {
            if (!guard.holds()) return false;
        }
        for (const auto &guard : functions) {
            if (!guard.holds()) return false;
        }
        for (const auto &guard : dicts) {
            if (!guard.holds()) return false;
        }
        return true;
    }
};

// The key of a call: false where it has none (a q, k or v that is no plain dense tensor, a tensor
// overriding torch functions or a mode that does, an int past int64). identities: objects keyed by address.
class KeyWriter {
   public:
    KeyWriter(PyObject *types, PyObject *parts) : identity_types(types), parts_attribute(parts) {}
    std::string key;
    std::vector<PyObject *> identities;
    PyObject *identity_types;  // a tuple of the types whose objects a key names by identity
    PyObject *parts_attribute;  // (a str) where such an object holds what it is made of, a tuple keyed by value

    bool tensor(PyObject *given) {
        return THPVariable_CheckExact(given) && append_tensor_words(THPVariable_Unpack(given), key);
    }

    // How deep a key follows tuples and functions' cells into tuples and functions (a window: one level;
    // compose's chain of built-ins: about six).
    static constexpr int kNesting = 8;
    static constexpr Py_ssize_t kTupleItems = 64;  // a longer tuple is keyed by identity in a cell (no key as a keyword)

    bool value(PyObject *given, int depth = 0) {
        if (given == Py_None) return tag('N');
        if (given == Py_True) return tag('T');
        if (given == Py_False) return tag('F');
        if (PyLong_CheckExact(given)) {
            int overflow = 0;
            long long number = PyLong_AsLongLongAndOverflow(given, &overflow);
            if (overflow != 0) return false;
            tag('i');
            word(number);
            return true;
        }
        if (PyFloat_CheckExact(given)) {
            double number = PyFloat_AS_DOUBLE(given);
            tag('f');
            key.append(reinterpret_cast<const char *>(&number), sizeof number);
            return true;
        }
        if (PyUnicode_CheckExact(given)) {
            Py_ssize_t size = 0;
            const char *text = PyUnicode_AsUTF8AndSize(given, &size);
            if (text == nullptr) {
                PyErr_Clear();
                return false;
            }
            tag('s');
            word(size);
            key.append(text, static_cast<size_t>(size));
            return true;
        }
        if (PyTuple_CheckExact(given)) {
            if (depth > kNesting || PyTuple_GET_SIZE(given) > kTupleItems) return false;  // (a key stays short)
            tag('t');
            word(PyTuple_GET_SIZE(given));
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(given); ++i) {
                if (!value(PyTuple_GET_ITEM(given, i), depth + 1)) return false;
            }
            return true;
        }
        if (Py_TYPE(given) == &PyFunction_Type) return function(given, depth);
        if (identity_types == nullptr || PySequence_Contains(identity_types, reinterpret_cast<PyObject *>(Py_TYPE(given))) != 1) {
            PyErr_Clear();
            return false;  // tensors, and objects an equal one may replace at each call: the Python path
        }
        PyObject *parts = made_of(given);
        if (parts != nullptr) {  // (a built-in score_mod: equal ones made anew at each call key alike)
            tag('m');
            return value(parts, depth + 1);
        }
        object(given);
        return true;
    }

    // The operands given as keywords (by their shapes, strides, dtypes, devices and requires_grad, like q, k, v).
    PyObject *bias = nullptr, *sink = nullptr;

    // q, k, v, the keywords (a dict), the grad mode and the settings' values (names: a tuple of str).
    bool call(PyObject *q, PyObject *k, PyObject *v, PyObject *keywords, PyObject *settings) {
        if (at::impl::torch_function_mode_enabled() || !tensor(q) || !tensor(k) || !tensor(v)) return false;
        if (!PyDict_CheckExact(keywords) || !PyTuple_CheckExact(settings)) return false;
        Py_ssize_t position = 0;
        PyObject *name = nullptr, *given = nullptr;
        while (PyDict_Next(keywords, &position, &name, &given)) {
            if (!value(name)) return false;
            PyObject **operand = operand_named(name);
            if (operand != nullptr && given != Py_None) {
                if (!tensor(given)) return false;
                *operand = given;
            } else if (!value(given)) {
                return false;
            }
        }
        tag(at::GradMode::is_enabled() ? 'G' : 'g');
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(settings); ++i) {
            const char *setting = PyUnicode_AsUTF8(PyTuple_GET_ITEM(settings, i));
            if (setting == nullptr) {
                PyErr_Clear();
                return false;
            }
            const char *found = std::getenv(setting);
            if (found == nullptr) {
                tag('-');
            } else {
                tag('=');
                word(static_cast<int64_t>(std::strlen(found)));
                key.append(found);
            }
        }
        return true;
    }

   private:
    // The tuple an object of an identity type names itself by (in its instance dict under parts_attribute), or
    // nullptr (borrowed).
    PyObject *made_of(PyObject *given) {
        if (parts_attribute == nullptr) return nullptr;
        PyObject **slot = _PyObject_GetDictPtr(given);
        if (slot == nullptr || *slot == nullptr) return nullptr;
        PyObject *parts = PyDict_GetItemWithError(*slot, parts_attribute);
        if (parts == nullptr) PyErr_Clear();
        return parts != nullptr && PyTuple_CheckExact(parts) ? parts : nullptr;
    }

    // A plain function by what decides what it computes: its code, its globals and its cells' contents, so
    // a closure made anew at each call over the same objects, as a model's forward writes it, finds the
    // entry of the one before. (What the code reads of its globals the entry's guards check.) One with
    // defaults has no key.
    bool function(PyObject *fn, int depth) {
        if (depth > kNesting) return false;
        if (PyFunction_GET_DEFAULTS(fn) != nullptr || PyFunction_GET_KW_DEFAULTS(fn) != nullptr) return false;
        tag('c');
        object(PyFunction_GET_CODE(fn));
        object(PyFunction_GET_GLOBALS(fn));
        PyObject *closure = PyFunction_GET_CLOSURE(fn);
        Py_ssize_t count = closure == nullptr ? 0 : PyTuple_GET_SIZE(closure);
        word(count);
        for (Py_ssize_t i = 0; i < count; ++i) {
            PyObject *content = PyCell_GET(PyTuple_GET_ITEM(closure, i));
            if (content == nullptr) {
                tag('e');
            } else if (PyFloat_CheckExact(content) || PyLong_CheckExact(content)) {
                if (!value(content)) return false;
            } else {
                cell(content, depth);
            }
        }
        return true;
    }
    // A cell's other content: a function by what it is made of, a tuple by its items (numbers, strings,
    // functions ...), where they have keys; anything else, or past kNesting levels (a function whose
    // cell holds itself), by identity, as a guard compares it. So a built-in made anew with its
    // helpers (ALiBi's slope, compose's chain of its parts) keys as the one before; a user's function in a
    // cell keys alike too, but its reads are no guard's to check, so no entry holds one (warm_entries.py).
    void cell(PyObject *content, int depth) {
        size_t length = key.size(), held = identities.size();
        bool keyed = (Py_TYPE(content) == &PyFunction_Type || PyTuple_CheckExact(content)) &&
                     value(content, depth + 1);
        if (keyed) return;
        key.resize(length);  // (what a failed try wrote)
        identities.resize(held);
        object(content);
    }
    void object(PyObject *given) {  // by identity: the entry holds it, so its address names it
        tag('o');
        word(reinterpret_cast<intptr_t>(given));
        identities.push_back(given);
    }
    PyObject **operand_named(PyObject *name) {
        if (PyUnicode_CompareWithASCIIString(name, "bias") == 0) return &bias;
        if (PyUnicode_CompareWithASCIIString(name, "sink") == 0) return &sink;
        return nullptr;
    }
    bool tag(char c) {
        key.push_back(c);
        return true;
    }
    void word(int64_t w) { key.append(reinterpret_cast<const char *>(&w), sizeof w); }
};

// The entries, at most `capacity` (all dropped when one more comes: a model has a few dozen calls).
struct Entries {
    std::unordered_map<std::string, std::shared_ptr<Entry>> by_key;
    size_t capacity = 0;                 // from Python (warm_configure)
    PyObject *settings = nullptr;        // the environment settings a key reads (a tuple of str), from Python
    PyObject *identity_types = nullptr;  // the keyword types a key names by identity (a tuple of types)
    PyObject *parts_attribute = nullptr;  // where such an object may name what it is made of instead (a str)
};
inline Entries &entries() {
    static auto *kept = new Entries();  // never destroyed: its objects may outlive the interpreter's end
    return *kept;
}

}  // namespace fusedattn_warm
