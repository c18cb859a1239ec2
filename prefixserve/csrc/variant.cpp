// One compiled variant as a Python extension module (prefixserve._kernels_<variant>): its only
// content is `table`, a capsule holding the variant's KernelTable, and `name`. Plain CPython API,
// no pybind or torch headers, so each variant costs only its kernels' compile time. Python imports
// a variant only on a CPU that runs its instructions (its module initialiser is compiled with them).
#include <Python.h>

#include "kernels.h"
#include "lora.h"
#include "peak.h"
#include "rowwise.h"
#include "simd.h"

#define PREFIXSERVE_STRING2(x) #x
#define PREFIXSERVE_STRING(x) PREFIXSERVE_STRING2(x)
#define PREFIXSERVE_CONCAT2(a, b) a##b
#define PREFIXSERVE_CONCAT(a, b) PREFIXSERVE_CONCAT2(a, b)

#if !defined(PREFIXSERVE_VARIANT) || !defined(TORCH_EXTENSION_NAME)
#error "setup.py defines PREFIXSERVE_VARIANT and TORCH_EXTENSION_NAME for each variant"
#endif

namespace {

template <typename T>
constexpr prefixserve::RowwiseKernels<T> rowwise() {
#if PREFIXSERVE_SIMD_FUSED
    return {&prefixserve::rms_norm_rows<T>, &prefixserve::add_rms_norm_rows<T>, &prefixserve::rotate_heads_rows<T>,
            &prefixserve::silu_mul_rows<T>};
#else
    return {nullptr, nullptr, nullptr, nullptr};
#endif
}

const prefixserve::KernelTable table = {
    prefixserve::KERNEL_TABLE_VERSION,
    PREFIXSERVE_STRING(PREFIXSERVE_VARIANT),
    prefixserve::simd::BACKEND,
    prefixserve::simd::W,
#if defined(__AVX512BF16__)
    true,
#else
    false,
#endif
    &prefixserve::causal_kernel<float>,
    &prefixserve::causal_kernel<at::BFloat16>,
    rowwise<float>(),
    rowwise<at::BFloat16>(),
    &prefixserve::multiply_add_flops,
    &prefixserve::quantized_matmul,
    &prefixserve::dequantize_rows,
    &prefixserve::lora_add_rows<float>,
    &prefixserve::lora_add_rows<at::BFloat16>,
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, PREFIXSERVE_STRING(TORCH_EXTENSION_NAME),
    "One compiled variant of prefixserve's CPU kernels (a KernelTable for prefixserve._C)", -1, nullptr,
};

}  // namespace

PyMODINIT_FUNC PREFIXSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
    PyObject* module = PyModule_Create(&module_def);
    if (module == nullptr) return nullptr;
    PyObject* capsule = PyCapsule_New(const_cast<prefixserve::KernelTable*>(&table), prefixserve::KERNEL_TABLE_CAPSULE,
                                      nullptr);
    if (capsule == nullptr || PyModule_AddObject(module, "table", capsule) < 0 ||
        PyModule_AddStringConstant(module, "name", table.variant) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
