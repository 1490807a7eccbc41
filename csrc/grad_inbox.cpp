// The native gradient inbox of the "hooks" intake (accumkernels/optim/_intake.py).
//
// Each wrapped param's gradient accumulator (its AccumulateGrad node) gets a
// C++ pre-hook. In the common case (a param's first gradient of the
// micro-step, dense, laid out like its buffer, the param as wrapped, its
// .grad the intake's marker or unset) the hook queues the gradient for its
// bucket and returns none, so autograd adds nothing into .grad, all without
// Python. The bucket's last gradient folds the bucket here, when Python armed
// the inbox for it (inbox_buffers, inbox_arm: whether the bucket's params
// are all new to the window, so the fold overwrites, or all in it, so it
// adds), calling accumulate_ as the Python fold would and then the intake's
// folded([index, ...]) for its bookkeeping; else it calls the
// intake's deliver(bucket, [(index, grad), ...]), which folds the bucket
// in Python. Every other gradient
// goes to the intake's Python pre-hook (the `slow` callable), which names
// what is wrong or handles the rare case, and the inbox stays out of the way
// until the next micro-step (so the Python side never sees half its state
// here). A Python hook per param costs autograd a GIL round trip and a call
// of several microseconds; here a gradient costs a lock and a vector append.
//
// What the inbox holds between deliveries (the queued gradients of buckets
// not yet complete) Python takes with inbox_drain() before it reads its own
// state (at step(), zero_grad(), flush()).
//
// The module functions (added to accumkernels._C by module.cpp):
//   inbox_new(deliver, folded, expected: list[int], params: int) -> capsule
//   inbox_hook(inbox, index, bucket, param, marker, contiguous, strides, slow)
//   inbox_start(inbox, enabled)     a new micro-step: no param has a gradient yet; disarmed
//   inbox_buffers(inbox, buffers)   each param's fp32 buffer (None: drop them)
//   inbox_arm(inbox, modes, found_inf)   fold complete buckets here until the next start
//   inbox_expect(inbox, expected)   the gradients that complete each bucket
//   inbox_drain(inbox) -> [(bucket, [(index, grad), ...]), ...]
//   inbox_stray(inbox) -> [index, ...]   params whose .grad is not their marker
//   inbox_remarked(inbox) -> [index, ...]   params whose unset .grad got its marker back since the last call
//   inbox_release(inbox, index)     the param's hook passes gradients through
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>  // Node::add_pre_hook (torch < 2.14 does not include it through variable.h)
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace accumkernels {
namespace {

using torch::autograd::variable_list;
using Queued = std::vector<std::pair<int64_t, at::Tensor>>;

// A reference to a Python object that may be dropped without the GIL (an
// autograd node, and with it its hooks, may be freed by the engine).
struct PyRef {
  PyObject* object = nullptr;
  explicit PyRef(PyObject* o) : object(o) { Py_XINCREF(o); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (object != nullptr && Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(object);
      PyGILState_Release(state);
    }
  }
};

// What a complete bucket's gradients become (inbox_arm; the values are the
// Python side's, HookIntake._fold_mode).
enum FoldMode : uint8_t {
  kDeliver = 0,    // handed to Python (deliver), which folds them
  kOverwrite = 1,  // folded here with overwrite=True: none of the bucket's params is in the window yet
  kAdd = 2,        // folded here, added: every param of the bucket that can get a gradient is in the window
};

struct Inbox {
  std::mutex mutex;
  bool enabled = false;                // the hooks may queue (else every gradient goes to Python)
  bool armed = false;                  // complete buckets are folded here as `modes` says (inbox_arm)
  std::vector<int64_t> expected;       // bucket -> gradients that complete it
  std::vector<Queued> queued;          // bucket -> gradients queued, not yet delivered
  std::vector<uint8_t> arrived;        // param -> got a gradient this micro-step
  std::vector<uint8_t> released;       // param -> its hook passes gradients through
  std::vector<uint8_t> remarked;       // param -> its unset .grad got the marker back (inbox_remarked)
  std::vector<at::Tensor> params, markers;  // param -> the param and its .grad marker (once hooked)
  std::vector<uint8_t> modes;          // bucket -> FoldMode
  std::vector<at::Tensor> buffers;     // param -> its fp32 buffer (for the folds here; empty: none given)
  std::optional<at::Tensor> found_inf;  // the micro-step's inf/NaN flag, where gradients are checked
  PyRef deliver, folded;

  Inbox(PyObject* deliver_fn, PyObject* folded_fn, std::vector<int64_t> expected_counts, int64_t count)
      : expected(std::move(expected_counts)),
        queued(expected.size()),
        arrived(count, 0),
        released(count, 0),
        remarked(count, 0),
        params(count),
        markers(count),
        modes(expected.size(), kDeliver),
        deliver(deliver_fn),
        folded(folded_fn) {}
};

// [(first, wrap(second)), ...] as a Python list of tuples.
template <class Pairs, class Wrap>
PyObject* pair_list(const Pairs& items, Wrap wrap) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* second = wrap(items[i].second);
    PyObject* pair =
        second == nullptr ? nullptr : Py_BuildValue("(LN)", static_cast<long long>(items[i].first), second);
    if (pair == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), pair);
  }
  return list;
}

// [index, ...] as a Python list of ints.
PyObject* index_list(const std::vector<int64_t>& indices) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(indices.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < indices.size(); ++i) {
    PyObject* value = PyLong_FromLongLong(indices[i]);
    if (value == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), value);
  }
  return list;
}

PyObject* wrap_queued(const Queued& items) {
  return pair_list(items, [](const at::Tensor& grad) { return THPVariable_Wrap(grad); });
}

// torch.ops.accumkernels.accumulate_ (csrc/ops.cpp), through the dispatcher
// as the Python fold calls it, so CPU and CUDA tensors reach their kernels.
using AccumulateFn = void(at::TensorList, at::TensorList, double, const std::optional<at::Tensor>&, bool,
                          const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<AccumulateFn>& accumulate_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("accumkernels::accumulate_", "").typed<AccumulateFn>();
  return op;
}

class InboxHook : public torch::autograd::FunctionPreHook {
 public:
  InboxHook(std::shared_ptr<Inbox> inbox, int64_t index, int64_t bucket, at::Tensor param, at::Tensor marker,
            bool contiguous, std::vector<int64_t> strides, PyObject* slow)
      : inbox_(std::move(inbox)),
        index_(index),
        bucket_(bucket),
        param_(std::move(param)),
        marker_(std::move(marker)),
        dtype_(param_.scalar_type()),
        device_(param_.device()),
        contiguous_(contiguous),
        strides_(std::move(strides)),
        slow_(slow) {}

  // Compiled autograd asks each hook to describe itself for tracing: the
  // wrapper's bookkeeping does not trace, so say so instead of torch's "nyi".
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "AccumulatingOptimizer does not run under compiled autograd "
                                "(torch._dynamo.compiled_autograd): run the backward without it (torch.compile of "
                                "the model and its forward works)");
  }

  variable_list operator()(const variable_list& grads) override {
    Inbox& box = *inbox_;
    {
      std::unique_lock<std::mutex> lock(box.mutex);
      if (box.released[index_]) return grads;
      if (box.enabled && grads.size() == 1 && queueable(grads[0], box)) {
        box.arrived[index_] = 1;
        Queued& queue = box.queued[bucket_];
        queue.emplace_back(index_, grads[0]);
        if (static_cast<int64_t>(queue.size()) < box.expected[bucket_]) return {at::Tensor()};
        Queued full = std::move(queue);
        queue.clear();
        const uint8_t mode = box.armed ? box.modes[bucket_] : kDeliver;
        if (mode == kDeliver) {
          lock.unlock();
          deliver(box, full);
          return {at::Tensor()};
        }
        std::vector<at::Tensor> buffers, grads;
        std::vector<int64_t> indices;
        for (const auto& [index, grad] : full) {
          buffers.push_back(box.buffers[index]);
          grads.push_back(grad);
          indices.push_back(index);
        }
        std::optional<at::Tensor> found_inf = box.found_inf;
        lock.unlock();
        fold(box, buffers, grads, indices, mode == kOverwrite, found_inf);
        return {at::Tensor()};
      }
      box.enabled = false;  // the rest of this micro-step goes through Python
    }
    return call_slow(grads);
  }

 private:
  // The common case, as the Python hook's fast path decides it (_arrive).
  bool queueable(const at::Tensor& grad, Inbox& box) {
    if (box.arrived[index_] || !grad.defined() || grad.layout() != at::kStrided) return false;
    if (param_.scalar_type() != dtype_ || param_.device() != device_ || grad.device() != device_) return false;
    if (!(contiguous_ && grad.is_contiguous()) && !grad.strides().equals(strides_)) return false;
    at::Tensor& held = param_.mutable_grad();
    if (!held.defined()) {  // cleared (model.zero_grad(), .grad = None): step() asks (inbox_remarked)
      held = marker_;
      box.remarked[index_] = 1;
    } else if (!held.is_same(marker_)) {
      return false;  // a tensor put into .grad by other code: Python takes it in
    }
    return true;
  }

  // HookIntake._fold's kernel call for a bucket of first gradients (scale 1:
  // the inbox is armed only without a loss scaler), then its bookkeeping in
  // Python (the window's params, the micro-step's arrivals: folded(indices)).
  void fold(Inbox& box, const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& grads,
            const std::vector<int64_t>& indices, bool overwrite, const std::optional<at::Tensor>& found_inf) {
    {
      c10::AutoGradMode no_grad(false);  // as the Python fold, under torch.no_grad()
      accumulate_op().call(buffers, grads, 1.0, std::nullopt, overwrite, found_inf);
    }
    pybind11::gil_scoped_acquire gil;
    PyObject* list = index_list(indices);
    if (list == nullptr) throw python_error();
    PyObject* result = PyObject_CallOneArg(box.folded.object, list);
    Py_DECREF(list);
    if (result == nullptr) throw python_error();
    Py_DECREF(result);
  }

  void deliver(Inbox& box, const Queued& full) {
    pybind11::gil_scoped_acquire gil;
    PyObject* items = wrap_queued(full);
    if (items == nullptr) throw python_error();
    PyObject* result = PyObject_CallFunction(box.deliver.object, "LN", static_cast<long long>(bucket_), items);
    if (result == nullptr) throw python_error();
    Py_DECREF(result);
  }

  variable_list call_slow(const variable_list& grads) {
    pybind11::gil_scoped_acquire gil;
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(grads.size()));
    if (list == nullptr) throw python_error();
    for (size_t i = 0; i < grads.size(); ++i) {
      PyObject* item = grads[i].defined() ? THPVariable_Wrap(grads[i]) : (Py_INCREF(Py_None), Py_None);
      if (item == nullptr) {
        Py_DECREF(list);
        throw python_error();
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
    }
    PyObject* result = PyObject_CallOneArg(slow_.object, list);
    Py_DECREF(list);
    if (result == nullptr) throw python_error();
    if (result == Py_None) {
      Py_DECREF(result);
      return grads;
    }
    variable_list out;
    PyObject* seq = PySequence_Fast(result, "the intake's pre-hook must return None or a sequence of gradients");
    Py_DECREF(result);
    if (seq == nullptr) throw python_error();
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
      out.push_back(item == Py_None ? at::Tensor() : THPVariable_Unpack(item));
    }
    Py_DECREF(seq);
    return out;
  }

  std::shared_ptr<Inbox> inbox_;
  int64_t index_, bucket_;
  at::Tensor param_, marker_;
  at::ScalarType dtype_;
  at::Device device_;
  bool contiguous_;
  std::vector<int64_t> strides_;
  PyRef slow_;
};

constexpr const char* kCapsule = "accumkernels.GradInbox";

void free_capsule(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Inbox>*>(PyCapsule_GetPointer(capsule, kCapsule));
}

std::shared_ptr<Inbox>* unwrap(PyObject* capsule) {
  return static_cast<std::shared_ptr<Inbox>*>(PyCapsule_GetPointer(capsule, kCapsule));
}

bool int_list(PyObject* obj, std::vector<int64_t>& out) {
  PyObject* seq = PySequence_Fast(obj, "expected a sequence of ints");
  if (seq == nullptr) return false;
  out.clear();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(seq);
  return true;
}

PyObject* inbox_new(PyObject*, PyObject* args) {
  PyObject *deliver, *folded, *expected_obj;
  long long params;
  if (!PyArg_ParseTuple(args, "OOOL", &deliver, &folded, &expected_obj, &params)) return nullptr;
  std::vector<int64_t> expected;
  if (!int_list(expected_obj, expected)) return nullptr;
  auto* inbox = new std::shared_ptr<Inbox>(std::make_shared<Inbox>(deliver, folded, std::move(expected), params));
  PyObject* capsule = PyCapsule_New(inbox, kCapsule, free_capsule);
  if (capsule == nullptr) delete inbox;
  return capsule;
}

PyObject* inbox_hook(PyObject*, PyObject* args) {
  PyObject *capsule, *param, *marker, *strides_obj, *slow;
  long long index, bucket;
  int contiguous;
  if (!PyArg_ParseTuple(args, "OLLOOpOO", &capsule, &index, &bucket, &param, &marker, &contiguous, &strides_obj,
                        &slow))
    return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  if (!THPVariable_Check(param) || !THPVariable_Check(marker)) {
    PyErr_SetString(PyExc_TypeError, "inbox_hook: param and marker must be tensors");
    return nullptr;
  }
  std::vector<int64_t> strides;
  if (!int_list(strides_obj, strides)) return nullptr;
  Inbox& box = **inbox;
  if (index < 0 || index >= static_cast<long long>(box.arrived.size()) || bucket < 0 ||
      bucket >= static_cast<long long>(box.expected.size())) {
    PyErr_SetString(PyExc_IndexError, "inbox_hook: param or bucket index out of range");
    return nullptr;
  }
  HANDLE_TH_ERRORS
  const at::Tensor& p = THPVariable_Unpack(param);
  const at::Tensor& m = THPVariable_Unpack(marker);
  auto node = torch::autograd::impl::grad_accumulator(p);
  TORCH_CHECK(node, "inbox_hook: the param has no gradient accumulator (it does not require grad)");
  {
    std::lock_guard<std::mutex> lock(box.mutex);
    box.params[index] = p;
    box.markers[index] = m;
  }
  node->add_pre_hook(std::make_unique<InboxHook>(*inbox, index, bucket, p, m, contiguous != 0, std::move(strides), slow));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* inbox_start(PyObject*, PyObject* args) {
  PyObject* capsule;
  int enabled;
  if (!PyArg_ParseTuple(args, "Op", &capsule, &enabled)) return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::lock_guard<std::mutex> lock(box.mutex);
  std::fill(box.arrived.begin(), box.arrived.end(), 0);
  box.enabled = enabled != 0;
  box.armed = false;
  Py_RETURN_NONE;
}

// inbox_buffers(inbox, buffers): each param's fp32 buffer, for the folds
// here (None: none, and nothing is folded here until they are given again).
PyObject* inbox_buffers(PyObject*, PyObject* args) {
  PyObject *capsule, *buffers_obj;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &buffers_obj)) return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::vector<at::Tensor> buffers;
  if (buffers_obj != Py_None) {
    PyObject* seq = PySequence_Fast(buffers_obj, "inbox_buffers: buffers must be a sequence of tensors");
    if (seq == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
      if (!THPVariable_Check(item)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "inbox_buffers: buffers must be a sequence of tensors");
        return nullptr;
      }
      buffers.push_back(THPVariable_Unpack(item));
    }
    Py_DECREF(seq);
    if (buffers.size() != box.params.size()) {
      PyErr_SetString(PyExc_ValueError, "inbox_buffers: one buffer per param");
      return nullptr;
    }
  }
  std::lock_guard<std::mutex> lock(box.mutex);
  box.buffers = std::move(buffers);
  box.armed = false;
  Py_RETURN_NONE;
}

// inbox_arm(inbox, modes, found_inf): until the next inbox_start, fold each
// complete bucket as modes[bucket] says (a FoldMode; None keeps the last
// ones), checking its gradients for inf/NaN into found_inf (None: unchecked).
PyObject* inbox_arm(PyObject*, PyObject* args) {
  PyObject *capsule, *modes_obj, *found_inf_obj;
  if (!PyArg_ParseTuple(args, "OOO", &capsule, &modes_obj, &found_inf_obj)) return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::vector<int64_t> modes;
  if (modes_obj != Py_None) {
    if (!int_list(modes_obj, modes)) return nullptr;
    for (int64_t mode : modes) {
      if (mode != kDeliver && mode != kOverwrite && mode != kAdd) {
        PyErr_SetString(PyExc_ValueError, "inbox_arm: a mode is 0 (deliver), 1 (overwrite) or 2 (add)");
        return nullptr;
      }
    }
    if (modes.size() != box.expected.size()) {
      PyErr_SetString(PyExc_ValueError, "inbox_arm: one mode per bucket");
      return nullptr;
    }
  }
  if (found_inf_obj != Py_None && !THPVariable_Check(found_inf_obj)) {
    PyErr_SetString(PyExc_TypeError, "inbox_arm: found_inf must be a tensor or None");
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(box.mutex);
  if (box.buffers.empty()) {
    PyErr_SetString(PyExc_RuntimeError, "inbox_arm: no buffers (inbox_buffers first)");
    return nullptr;
  }
  if (modes_obj != Py_None) box.modes.assign(modes.begin(), modes.end());
  box.found_inf =
      found_inf_obj == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(found_inf_obj));
  box.armed = true;
  Py_RETURN_NONE;
}

PyObject* inbox_expect(PyObject*, PyObject* args) {
  PyObject *capsule, *expected_obj;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &expected_obj)) return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  std::vector<int64_t> expected;
  if (!int_list(expected_obj, expected)) return nullptr;
  Inbox& box = **inbox;
  std::lock_guard<std::mutex> lock(box.mutex);
  if (expected.size() != box.expected.size()) {
    PyErr_SetString(PyExc_ValueError, "inbox_expect: one count per bucket");
    return nullptr;
  }
  box.expected = std::move(expected);
  Py_RETURN_NONE;
}

PyObject* inbox_drain(PyObject*, PyObject* capsule) {
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::vector<std::pair<int64_t, Queued>> taken;
  {
    std::lock_guard<std::mutex> lock(box.mutex);
    for (size_t b = 0; b < box.queued.size(); ++b) {
      if (!box.queued[b].empty()) {
        taken.emplace_back(static_cast<int64_t>(b), std::move(box.queued[b]));
        box.queued[b].clear();
      }
    }
  }
  return pair_list(taken, wrap_queued);
}

// The indices i of the inbox's params for which pick(box, i) holds, taken
// under its lock (pick may update the entry it picks): the one scan behind
// inbox_stray and inbox_remarked.
template <typename Pick>
PyObject* indices_where(PyObject* capsule, Pick pick) {
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::vector<int64_t> picked;
  {
    std::lock_guard<std::mutex> lock(box.mutex);
    for (size_t i = 0; i < box.params.size(); ++i) {
      if (pick(box, i)) picked.push_back(static_cast<int64_t>(i));
    }
  }
  return index_list(picked);
}

// The hooked params whose .grad is not their marker (None included): the
// only ones step()'s check of .grad must look at (HookIntake.check_grads).
PyObject* inbox_stray(PyObject*, PyObject* capsule) {
  return indices_where(capsule, [](Inbox& box, size_t i) {
    return box.params[i].defined() && !box.released[i] && !box.params[i].grad().is_same(box.markers[i]);
  });
}

// The hooked params whose unset .grad got its marker back here since the last
// call (each a .grad cleared by other code, model.zero_grad() say), and forget
// them: step()'s check that the last step's gradients were cleared (HookIntake.uncleared).
PyObject* inbox_remarked(PyObject*, PyObject* capsule) {
  return indices_where(capsule, [](Inbox& box, size_t i) {
    const bool remarked = box.remarked[i] != 0;
    box.remarked[i] = 0;
    return remarked;
  });
}

PyObject* inbox_release(PyObject*, PyObject* args) {
  PyObject* capsule;
  long long index;
  if (!PyArg_ParseTuple(args, "OL", &capsule, &index)) return nullptr;
  auto* inbox = unwrap(capsule);
  if (inbox == nullptr) return nullptr;
  Inbox& box = **inbox;
  std::lock_guard<std::mutex> lock(box.mutex);
  if (index >= 0 && index < static_cast<long long>(box.released.size())) box.released[index] = 1;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"inbox_new", inbox_new, METH_VARARGS, "a gradient inbox: inbox_new(deliver, folded, expected, params)"},
    {"inbox_hook", inbox_hook, METH_VARARGS,
     "inbox_hook(inbox, index, bucket, param, marker, contiguous, strides, slow): the pre-hook on param's "
     "gradient accumulator"},
    {"inbox_start", inbox_start, METH_VARARGS, "inbox_start(inbox, enabled): a new micro-step, disarmed"},
    {"inbox_buffers", inbox_buffers, METH_VARARGS, "inbox_buffers(inbox, buffers): the buffers to fold into"},
    {"inbox_arm", inbox_arm, METH_VARARGS,
     "inbox_arm(inbox, modes, found_inf): fold complete buckets here until the next inbox_start"},
    {"inbox_expect", inbox_expect, METH_VARARGS, "inbox_expect(inbox, expected): gradients per bucket"},
    {"inbox_drain", inbox_drain, METH_O, "inbox_drain(inbox): the queued gradients, [(bucket, [(index, grad)])]"},
    {"inbox_stray", inbox_stray, METH_O, "inbox_stray(inbox): the hooked params whose .grad is not their marker"},
    {"inbox_remarked", inbox_remarked, METH_O,
     "inbox_remarked(inbox): the params whose unset .grad got its marker back since the last call"},
    {"inbox_release", inbox_release, METH_VARARGS, "inbox_release(inbox, index): pass the param's gradients through"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* grad_inbox_methods() { return methods; }

}  // namespace accumkernels
