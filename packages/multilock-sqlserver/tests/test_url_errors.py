"""URL mistakes: a mistyped option of ours is refused with the known ones (every other
name is an ODBC keyword for the driver), and no password in any error or its chain."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts
from multilock.sqlserver import SqlServerProvider
from multilock.sqlserver._connstr import parse_url

PASSWORD = "Corr3ct-h0rse"
KNOWN = (
    "known: driver, login_timeout, query_timeout, schema, table, and any ODBC keyword of the "
    "driver (Encrypt, TrustServerCertificate, ...)"
)


@pytest.mark.parametrize(
    ("option", "meant"),
    [("query_timout", "query_timeout"), ("QueryTimeout", "query_timeout"), ("Schema", "schema")],
)
def test_a_mistyped_option_of_ours_is_refused(option: str, meant: str) -> None:
    # Before: passed to the driver as an ODBC keyword, which ignored it.
    with pytest.raises(ConfigurationError) as caught:
        SqlServerProvider.from_url(f"mssql://u:{PASSWORD}@h/db?{option}=5")
    assert str(caught.value) == (
        f"unknown option {option!r} in the mssql URL (did you mean {meant!r}?); {KNOWN}"
    )
    assert all(PASSWORD not in text for text in texts(caught.value))


def test_odbc_keywords_still_pass_through() -> None:
    url = "sqlserver://h/db?Encrypt=yes&TrustServerCertificate=yes&trusted_connection=no"
    pairs, options = parse_url(url + "&TDS_Version=7.4&APP=elector&query_timeout=3")
    assert dict(pairs)["trusted_connection"] == "no"
    assert dict(pairs)["APP"] == "elector"
    assert options == {"query_timeout": "3"}


def test_a_name_that_is_no_keyword_is_refused_without_being_shown() -> None:
    # Before: "invalid ODBC keyword 'pwd:<password>' in the SQL Server URL".
    with pytest.raises(ConfigurationError) as caught:
        SqlServerProvider.from_url(f"mssql://h/db?pwd:{PASSWORD}=1")
    assert str(caught.value).startswith("unknown option <a name of ")
    assert all(PASSWORD not in text for text in texts(caught.value))


@pytest.mark.parametrize("build", [from_url, SqlServerProvider.from_url])
def test_a_password_cut_by_an_unencoded_slash_is_in_no_error(build: object) -> None:
    # Before: "invalid SQL Server URL ...: Port could not be cast to integer value as
    # '<the password's first half>'".
    with pytest.raises(ConfigurationError) as caught:
        build(f"mssql://u:{PASSWORD}/more@h/db")  # type: ignore[operator]
    assert "percent-encode" in str(caught.value)
    assert all(PASSWORD not in text for text in texts(caught.value))
