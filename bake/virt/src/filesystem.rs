//! `wasi:filesystem` with no preopened directories: no descriptor can ever exist.

use alloc::string::String;
use alloc::vec::Vec;

use crate::bindings::exports::wasi::filesystem::preopens;
use crate::bindings::exports::wasi::filesystem::types::{
    self, Advice, Descriptor, DescriptorBorrow, DescriptorFlags, DescriptorStat, DescriptorType,
    DirectoryEntry, DirectoryEntryStream, ErrorCode, Filesize, InputStream, MetadataHashValue,
    NewTimestamp, OpenFlags, OutputStream, PathFlags,
};
use crate::{Never, Virt};

/// No directories: the baked guest holds its model in memory and opens no file.
impl preopens::Guest for Virt {
    fn get_directories() -> Vec<(Descriptor, String)> {
        Vec::new()
    }
}

/// Descriptors come only from `get_directories` (and from other descriptors), so there are none.
impl types::Guest for Virt {
    type Descriptor = Never;
    type DirectoryEntryStream = Never;

    /// A stream error never comes from a file here, as there are no files.
    fn filesystem_error_code(_: &types::Error) -> Option<ErrorCode> {
        None
    }
}

/// A descriptor, of which there is none.
impl types::GuestDescriptor for Never {
    fn read_via_stream(&self, _: Filesize) -> Result<InputStream, ErrorCode> {
        match *self {}
    }

    fn write_via_stream(&self, _: Filesize) -> Result<OutputStream, ErrorCode> {
        match *self {}
    }

    fn append_via_stream(&self) -> Result<OutputStream, ErrorCode> {
        match *self {}
    }

    fn advise(&self, _: Filesize, _: Filesize, _: Advice) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn sync_data(&self) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn get_flags(&self) -> Result<DescriptorFlags, ErrorCode> {
        match *self {}
    }

    fn get_type(&self) -> Result<DescriptorType, ErrorCode> {
        match *self {}
    }

    fn set_size(&self, _: Filesize) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn set_times(&self, _: NewTimestamp, _: NewTimestamp) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn read(&self, _: Filesize, _: Filesize) -> Result<(Vec<u8>, bool), ErrorCode> {
        match *self {}
    }

    fn write(&self, _: Vec<u8>, _: Filesize) -> Result<Filesize, ErrorCode> {
        match *self {}
    }

    fn read_directory(&self) -> Result<DirectoryEntryStream, ErrorCode> {
        match *self {}
    }

    fn sync(&self) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn create_directory_at(&self, _: String) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn stat(&self) -> Result<DescriptorStat, ErrorCode> {
        match *self {}
    }

    fn stat_at(&self, _: PathFlags, _: String) -> Result<DescriptorStat, ErrorCode> {
        match *self {}
    }

    fn set_times_at(
        &self,
        _: PathFlags,
        _: String,
        _: NewTimestamp,
        _: NewTimestamp,
    ) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn link_at(
        &self,
        _: PathFlags,
        _: String,
        _: DescriptorBorrow<'_>,
        _: String,
    ) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn open_at(
        &self,
        _: PathFlags,
        _: String,
        _: OpenFlags,
        _: DescriptorFlags,
    ) -> Result<Descriptor, ErrorCode> {
        match *self {}
    }

    fn readlink_at(&self, _: String) -> Result<String, ErrorCode> {
        match *self {}
    }

    fn remove_directory_at(&self, _: String) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn rename_at(&self, _: String, _: DescriptorBorrow<'_>, _: String) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn symlink_at(&self, _: String, _: String) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn unlink_file_at(&self, _: String) -> Result<(), ErrorCode> {
        match *self {}
    }

    fn is_same_object(&self, _: DescriptorBorrow<'_>) -> bool {
        match *self {}
    }

    fn metadata_hash(&self) -> Result<MetadataHashValue, ErrorCode> {
        match *self {}
    }

    fn metadata_hash_at(&self, _: PathFlags, _: String) -> Result<MetadataHashValue, ErrorCode> {
        match *self {}
    }
}

/// A directory listing, of which there is none.
impl types::GuestDirectoryEntryStream for Never {
    fn read_directory_entry(&self) -> Result<Option<DirectoryEntry>, ErrorCode> {
        match *self {}
    }
}
