"""Specification of tvmattn.runtime.upload: plan copies to the device.

On CUDA the copy must not block the host, yet be ordered on the launch stream: consecutive
uploads into one device buffer, each read before the next, all arrive intact, and the caller
may overwrite its host array as soon as copy() returns.
"""

import numpy as np
import pytest
import tvm

from tvmattn.runtime.upload import AsyncUploader, HostUploader, SyncUploader, make_uploader


def test_cpu_writes_through_an_alias():
    uploader = make_uploader(tvm.cpu())
    assert isinstance(uploader, HostUploader)
    device_array = tvm.runtime.empty((5,), "int32", device=tvm.cpu())
    uploader.copy(np.arange(5, dtype=np.int32), device_array)
    np.testing.assert_array_equal(device_array.numpy(), np.arange(5))
    buffer = tvm.runtime.empty((16,), "int32", device=tvm.cpu())
    buffer.copyfrom(np.zeros(16, np.int32))
    views = [buffer._create_view((6,), "int32", 0), buffer._create_view((3,), "int32", 4 * 10)]
    for step, view in enumerate([views[0], views[0], views[1], views[0]]):  # the same view again, then others
        host = np.arange(view.shape[0], dtype=np.int32) + 100 * step
        uploader.copy(host, view)
        np.testing.assert_array_equal(view.numpy(), host)
    np.testing.assert_array_equal(buffer.numpy()[6:10], 0)  # nothing outside the views


def test_sync_uploader_copies():
    device_array = tvm.runtime.empty((5,), "int32", device=tvm.cpu())
    SyncUploader().copy(np.arange(5, dtype=np.int32), device_array)
    np.testing.assert_array_equal(device_array.numpy(), np.arange(5))


@pytest.mark.parametrize("uploader", [HostUploader, SyncUploader])
def test_copies_into_the_first_elements_of_a_larger_tensor(uploader):
    """DeviceArrays uploads every plan into its whole buffer: the plan's n elements go first,
    the rest stays as it was."""
    uploader = uploader()
    buffer = tvm.runtime.empty((40,), "int32", device=tvm.cpu())
    buffer.copyfrom(np.full(40, -7, np.int32))
    for step, size in enumerate([5, 33, 2, 40, 17]):
        host = np.arange(size, dtype=np.int32) + 100 * step
        uploader.copy(host, buffer)
        np.testing.assert_array_equal(buffer.numpy()[:size], host)
    np.testing.assert_array_equal(buffer.numpy()[17:], np.arange(17, 40) + 300)  # step 3's, untouched since


@pytest.mark.gpu
def test_cuda_uploads_are_asynchronous_and_stream_ordered():
    device = tvm.cuda(0)
    uploader = make_uploader(device)
    assert isinstance(uploader, AsyncUploader)
    device_array = tvm.runtime.empty((1 << 16,), "int32", device=device)
    for step, size in enumerate([1000, 70000 // 2, 17, 1 << 16, 1000, 3]):
        host = (np.arange(size, dtype=np.int32) + 1) * (step + 1)
        expected = host.copy()
        view = device_array._create_view((size,), "int32", 0)
        uploader.copy(host, view if step % 2 else device_array)  # a view of its size, or the whole buffer
        host[:] = -1  # the staging buffer holds the data: the caller's array is free at once
        np.testing.assert_array_equal(view.numpy(), expected)
