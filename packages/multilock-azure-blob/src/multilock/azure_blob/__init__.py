"""multilock.azure_blob: leader election on Azure Blob Storage blob leases."""

from ._provider import AzureBlobProvider
from ._record import MAX_LEASE, MIN_LEASE

__all__ = ["MAX_LEASE", "MIN_LEASE", "AzureBlobProvider"]
