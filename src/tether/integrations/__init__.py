"""Optional bridges to other libraries (imported only when that library is installed)."""
